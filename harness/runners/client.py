"""A small OpenAI-API client over urllib (no extra dependency): completions, chat, streaming, tokenize."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class RequestFailed(RuntimeError):
    """The server answered with an HTTP error or unreadable body; the message names the status and body start."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class OpenAIClient:
    base_url: str
    model: str
    timeout_s: float = 600.0

    def _open(self, path: str, body: dict[str, Any]):
        data = json.dumps({"model": self.model, **body}).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
            raise RequestFailed(f"POST {path} -> HTTP {exc.code}: {detail}", exc.code) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise RequestFailed(f"POST {path} failed: {exc}") from None

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._open(path, body) as resp:
            try:
                return json.loads(resp.read())
            except json.JSONDecodeError as exc:
                raise RequestFailed(f"POST {path}: the answer is not JSON ({exc})") from None

    def completion(self, **body: Any) -> dict[str, Any]:
        return self.post("/v1/completions", body)

    def chat(self, **body: Any) -> dict[str, Any]:
        return self.post("/v1/chat/completions", body)

    def stream_completion(self, **body: Any) -> Iterator[dict[str, Any]]:
        """Server-sent events of a streamed completion, as parsed chunks (the final [DONE] is consumed)."""
        with self._open("/v1/completions", {**body, "stream": True}) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)
        raise RequestFailed("the stream ended without [DONE]")

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.post("/tokenize", {"prompt": prompt, "add_special_tokens": False})["tokens"])

    def detokenize(self, tokens: list[int]) -> str:
        return str(self.post("/detokenize", {"tokens": tokens})["prompt"])


def token_id(entry: str) -> int:
    """The id in a `token_id:123` string (what `return_tokens_as_token_ids` makes logprob keys look like)."""
    if not entry.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:<n>', got {entry!r} — request return_tokens_as_token_ids")
    return int(entry.split(":", 1)[1])
