"""The `k3gate` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from harness.errors import UsageError
from harness.verdicts import ExitCode

err = Console(stderr=True, highlight=False, soft_wrap=True)

# Modules that add a subcommand through `register(subparsers)`.
EXTRA_COMMANDS = (
    "harness.redteam",
    "harness.isolation.command",
    "harness.bundle.sigstore_sign",
    "harness.byo",
    "suites.sanitize",
    "harness.kernels_cmd",
)

VERDICT_STYLE = {
    "PASSED": "green",
    "FAILED": "red",
    "ERROR": "red",
    "NOT_RUN": "yellow",
    "INCOMPLETE": "yellow",
}


def default_config_name() -> tuple[str, str]:
    """(config, why) for the hardware of this machine."""
    from harness.hardware import detect

    hw = detect()
    if hw.kind == "none":
        return "cpu-smoke", "no CUDA GPU found"
    if hw.kind == "h200":
        return "h200", f"found {hw.describe()}"
    if hw.kind == "gb300" and hw.count >= 16:
        return "tp16-gb300", f"found {hw.describe()}"
    if hw.kind == "gb300" and hw.count >= 8:
        return "tp8-gb300", f"found {hw.describe()}"
    return "cpu-smoke", f"found {hw.describe()}, for which no config is shipped"


def _signing_key(path: str | None):
    from harness.bundle import keys

    if path:
        return keys.load_private(Path(path))
    default = keys.default_key_path()
    if default.exists():
        return keys.load_private(default)
    key = keys.generate(default)
    err.print(
        f"[bold]created your signing key[/] {default} (keyid {key.keyid[:16]}…); "
        f"share {default.with_suffix('.pub')} so reviewers can trust your bundles"
    )
    return key


def cmd_run(args: argparse.Namespace) -> int:
    from harness import pipeline
    from harness.config.loader import load_config
    from harness.hardware import detect

    if args.config is None:
        name, why = default_config_name()
        err.print(f"using config [bold]{name}[/] ({why}); pass --config to choose another")
    else:
        name = args.config
    config = load_config(name, args.tier)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages is not None else None
    if stages is not None and not stages:
        raise UsageError("--stages is empty — name stages separated by commas, e.g. --stages numerics,perf")
    pipeline.select_stages(stages)  # reject unknown names before any work
    key = _signing_key(args.key)
    hw = detect()

    status = err.status("starting", spinner="dots") if err.is_terminal and not args.quiet else None
    if status:
        status.start()

    def listener(event: str, stage: str, detail: str) -> None:
        if (event == "start" and status) or (event == "progress" and status):
            status.update(f"[bold]{stage}[/]: {detail}")
        elif event == "done" and not args.quiet:
            verdict = detail.split(":", 1)[0]
            err.print(f"  [{VERDICT_STYLE.get(verdict, 'white')}]{verdict:<8}[/] {stage:<12} ", end="")
            err.print(detail.split(":", 1)[1].strip(), markup=False)  # reasons quote logs: no markup

    err.print(f"k3gate run: config {config.name}, tier {config.tier}, subject {config.subject}, {hw.describe()}")
    try:
        result = pipeline.run(config, hw, key, Path(args.out) if args.out else None, stages, listener)
    finally:
        if status:
            status.stop()
    outcome = result.outcome
    err.print(f"[bold {VERDICT_STYLE[outcome.outcome.value]}]{outcome.outcome.value}[/]: {outcome.reason}")
    err.print(f"bundle {result.bundle_dir} ({result.archive.name}), id {result.bundle_id}")
    if args.json:
        print(
            json.dumps(
                {
                    "outcome": outcome.outcome.value,
                    "reason": outcome.reason,
                    "exit_code": int(outcome.exit_code),
                    "config": config.name,
                    "tier": config.tier,
                    "bundle_dir": str(result.bundle_dir),
                    "archive": str(result.archive),
                    "bundle_id": result.bundle_id,
                    "verdicts": [v.to_json() for v in result.verdicts],
                },
                indent=2,
            )
        )
    return int(outcome.exit_code)


def cmd_configs(args: argparse.Namespace) -> int:
    from harness.config.loader import builtin_names, load_config

    for name in builtin_names():
        c = load_config(name)
        hw = c.hardware
        where = "CPU" if hw["gpu"] == "none" else f"{hw['gpu_count']}x {hw['gpu']}"
        print(f"{name:<12} {c.subject:<10} {where:<10} tier {c.tier:<8} {c.data['description']}")
    return 0


def cmd_show_config(args: argparse.Namespace) -> int:
    import tomli_w

    from harness.config.loader import load_config

    c = load_config(args.name, args.tier)
    print(f"# {c.name} (from {c.source}), tier {c.tier}; required stages: {', '.join(c.required_stages)}")
    print(tomli_w.dumps(c.resolved()), end="")
    return 0


def _trusted(args: argparse.Namespace):
    from harness.bundle.keys import load_trusted

    if args.key is None and args.keys is None:
        return None
    return load_trusted(Path(args.key) if args.key else None, Path(args.keys) if args.keys else None)


def cmd_verify(args: argparse.Namespace) -> int:
    from harness.bundle.verify import verify

    report = verify(Path(args.bundle), _trusted(args))
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "bundle_id": report.bundle_id,
                    "problems": report.problems,
                    "signer": report.signer.describe() if report.signer else None,
                    "outcome": report.predicate["outcome"] if report.predicate else None,
                },
                indent=2,
            )
        )
    if report.ok:
        outcome = report.predicate["outcome"]["outcome"]
        err.print(
            f"[green]OK[/]: bundle {report.bundle_id} is intact; every verdict re-derived from its records "
            f"(recorded outcome {outcome})"
        )
        err.print(f"signer: {report.signer.describe()}")
        return 0
    err.print(f"[red]FAILED[/]: {args.bundle} did not verify ({len(report.problems)} problems)")
    for p in report.problems:
        err.print(f"  - {p}", soft_wrap=True)
    return int(ExitCode.FAILED)


def cmd_report(args: argparse.Namespace) -> int:
    from harness.bundle import archive
    from harness.bundle.verify import verify_dir
    from harness.report import markdown, page

    path = Path(args.bundle)
    if not path.exists():
        raise UsageError(f"bundle {path} does not exist — give a bundle directory or its .tar.gz")
    with tempfile.TemporaryDirectory(prefix="k3gate-report-") as tmp:
        if path.is_dir():
            root = path
        else:
            try:
                root = archive.unpack(path, Path(tmp))
            except archive.ArchiveError as exc:
                err.print(f"[red]cannot report[/]: {exc}")
                return int(ExitCode.FAILED)
        check = verify_dir(root)
        if not check.ok:
            err.print(
                f"[red]cannot report[/]: the bundle does not verify ({check.problems[0]}); "
                "run `k3gate verify` for every problem"
            )
            return int(ExitCode.FAILED)
        render = markdown.render if args.format == "md" else page.render
        text = render(check.predicate, root, check.bundle_id, check.signer.describe())
    if args.out:
        Path(args.out).write_text(text)
        err.print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from harness.bundle import keys

    path = Path(args.out) if args.out else keys.default_key_path()
    key = keys.generate(path, force=args.force)
    err.print(f"wrote {path} (private, mode 0600) and {path.with_suffix('.pub')}")
    print(keys.openssh_line(key.public))
    err.print(f"keyid {key.keyid}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3gate",
        description="Validation gate for model-specific decode "
        "optimizations: isolation, scope, numerics, evals, performance — in a signed bundle.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run the gate and write a signed bundle")
    r.add_argument("--config", help="config name (see `k3gate configs`) or a .toml path; default: by hardware")
    r.add_argument("--out", help="bundle folder to create (default: k3gate-out/<config>-<time>)")
    r.add_argument("--stages", help="comma-separated stages to run (environment and bundle always run)")
    r.add_argument("--tier", choices=["smoke", "standard", "full"], help="override the config's tier")
    r.add_argument("--key", help="ed25519 private key (k3gate or OpenSSH); default: your k3gate key")
    r.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    r.add_argument("--quiet", action="store_true", help="print only the outcome")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("configs", help="list the shipped configs")
    c.set_defaults(fn=cmd_configs)

    s = sub.add_parser("show-config", help="print a config as the run resolves it")
    s.add_argument("name")
    s.add_argument("--tier", choices=["smoke", "standard", "full"])
    s.set_defaults(fn=cmd_show_config)

    v = sub.add_parser("verify", help="verify a bundle's signature, digests and verdicts")
    v.add_argument("bundle", help="bundle folder or .tar.gz")
    v.add_argument("--key", help="trusted signer public key (OpenSSH line(s) or PEM)")
    v.add_argument("--keys", help="folder of trusted *.pub / *.keys files")
    v.add_argument("--json", action="store_true")
    importlib.import_module("harness.bundle.sigstore_policy").add_options(v)  # --sigstore-*: a CI seal's identity
    v.set_defaults(fn=cmd_verify)

    rep = sub.add_parser("report", help="render a verified bundle as markdown or HTML")
    rep.add_argument("bundle")
    rep.add_argument("--format", choices=["md", "html"], default="md")
    rep.add_argument("--out", help="write to this file instead of stdout")
    rep.set_defaults(fn=cmd_report)

    k = sub.add_parser("keygen", help="create an ed25519 signing key")
    k.add_argument("--out", help="private key path (default: your k3gate config folder)")
    k.add_argument("--force", action="store_true", help="replace an existing key")
    k.set_defaults(fn=cmd_keygen)
    for module in EXTRA_COMMANDS:
        importlib.import_module(module).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as exc:
        err.print(f"k3gate: error: {exc}", soft_wrap=True, markup=False)
        return int(ExitCode.USAGE)
    except KeyboardInterrupt:
        err.print("k3gate: interrupted; no bundle was sealed", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
