"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for the runner's failure-path tests.

FAKE_SERVER_MODE: "crash" exits at once with an error in its log; "hang" never answers /health and leaves a
child process in its group (which stopping the server must also end); "healthy" answers /health and writes its
child's pid so tests can check the whole group is gone after stop.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import time


def main() -> None:
    mode = os.environ.get("FAKE_SERVER_MODE", "hang")
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if pid_file := os.environ.get("FAKE_SERVER_CHILD_PID"):
        with open(pid_file, "w") as fh:
            fh.write(str(child.pid))
    print("fake server starting", flush=True)
    if mode == "crash":
        print("ValueError: this model does not support TP other than 8/16", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(3600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()


if __name__ == "__main__":
    main()
