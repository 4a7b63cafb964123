"""`k3gate kernels build` without any real toolchain: a synthetic cubin, fake build sets, expectations as data.

The real kernels are built and checked in tests/k3_decode/kernels/test_build.py (needs CuTe DSL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import kernels_cmd
from harness.errors import UsageError
from harness.kernels_cmd import (
    CubinError,
    KernelArtifacts,
    Rule,
    cubin_resources,
    main,
    parse_expectations,
    tag_sum,
)

MODULE = "tests.harness.test_kernels_cmd"


# --- a synthetic cubin --------------------------------------------------------------------------------------------


def make_cubin(kernels: Mapping[str, tuple[int, int]], shared: int = 0) -> bytes:
    """A minimal 64-bit CUDA ELF: one .text section per kernel, registers and frame bytes in the global .nv.info."""
    names = list(kernels)
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    offsets = [1 + sum(len(n) + 1 for n in names[:i]) for i in range(len(names))]
    symtab = bytes(24) + b"".join(struct.pack("<IBBHQQ", off, 0x12, 0, 0, 0, 0) for off in offsets)
    info = b""
    for sym, name in enumerate(names, start=1):
        regs, frame = kernels[name]
        info += struct.pack("<BBHII", 0x04, 0x2F, 8, sym, regs)  # EIATTR_REGCOUNT
        info += struct.pack("<BBH", 0x03, 0x1B, 0x00FF)  # a 2-byte attribute the reader must step over
        info += struct.pack("<BBHII", 0x04, 0x11, 8, sym, frame)  # EIATTR_FRAME_SIZE
    sections = [("", 0, b""), (".shstrtab", 3, b""), (".strtab", 3, strtab), (".symtab", 2, symtab)]
    sections.append((".nv.info", 0x70000000, info))
    sections += [(f".text.{n}", 1, b"\0" * 16) for n in names]
    sections += [(f".nv.shared.{n}", 8, b"") for n in names]
    shstr = b"\0" + b"".join(s[0].encode() + b"\0" for s in sections[1:])
    sections[1] = (".shstrtab", 3, shstr)
    name_at = [0] + [1 + sum(len(s[0]) + 1 for s in sections[1:i]) for i in range(1, len(sections))]
    body, at = b"", 64
    placed = []
    for _, _, data in sections:
        placed.append((at + len(body), len(data)))
        body += data
    shoff = 64 + len(body)
    headers = b""
    for i, (name, kind, _) in enumerate(sections):
        off, size = placed[i]
        if name.startswith(".nv.shared."):
            size = shared  # NOBITS: a size, no bytes
        headers += struct.pack("<IIQQQQIIQQ", name_at[i], kind, 0, 0, off, size, 0, 0, 1, 0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0x5A0D5A, 64, 0, 0, 64, len(sections), 1)
    return header + body + headers


def test_cubin_reader_finds_registers_frame_and_shared_memory():
    got = cubin_resources(make_cubin({"k_a": (40, 0), "k_b": (168, 24)}, shared=2304))
    assert got["k_a"].registers == 40 and got["k_a"].frame_bytes == 0
    assert got["k_b"].registers == 168 and got["k_b"].frame_bytes == 24
    assert got["k_b"].shared_bytes == 2304


@pytest.mark.parametrize(
    "blob, problem",
    [(b"not an elf at all", "not a 64-bit"), (b"\x7fELF" + bytes([1, 1]) + bytes(58), "not a 64-bit")],
)
def test_cubin_reader_rejects_what_is_not_a_cubin(blob, problem):
    with pytest.raises(CubinError, match=problem):
        cubin_resources(blob)


# --- expectations -------------------------------------------------------------------------------------------------

GOOD = """
[sm_90a.k]
max_registers = 64
max_frame_bytes = 0
[[sm_90a.k.rules]]
in = "ptx"
pattern = 'ld\\.global'
count = "loads"
why = "one load per row"
"""


def test_expectations_parse_into_rules():
    exp = parse_expectations(GOOD, "good.toml", "sm_90a")
    assert exp["k"].max_registers == 64 and exp["k"].rules[0].count == "loads"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[sm_80.k]\nmax_registers = 1\nmax_frame_bytes = 0", "has no [sm_90a] expectations"),
        ("[sm_90a.k]\nmax_registers = 1", "max_frame_bytes"),
        ("[sm_90a.k]\nmax_registers = 1\nmax_frame_bytes = 0\nspeed = 3", "unknown key 'speed'"),
        (GOOD.replace("'ld\\.global'", "'ld\\.(global'"), "bad regular expression"),
        (GOOD.replace('why = "one load per row"', ""), "needs a `why`"),
        (GOOD.replace('count = "loads"', ""), "needs `count`, `min` or `max`"),
        (GOOD.replace('in = "ptx"', 'in = "cubin"'), '`in` must be "ptx" or "sass"'),
        (GOOD.replace('count = "loads"', "min = -1"), "`min` must be a non-negative integer"),
        ("[sm_90a\n", "not valid TOML"),
    ],
)
def test_malformed_expectations_are_one_line_usage_errors(text, message):
    with pytest.raises(UsageError, match=re.escape(message)) as err:
        parse_expectations(text, "bad.toml", "sm_90a")
    assert "\n" not in str(err.value)


ALLOWING = GOOD.replace(
    "max_frame_bytes = 0\n",
    "max_frame_bytes = 0\n"
    'frame_allowances = [{ when = { tp = 16, partial = true }, max_frame_bytes = 16, why = "measured" }]\n',
    1,
)


def test_a_frame_allowance_raises_the_limit_only_for_the_builds_its_when_selects():
    exp = parse_expectations(ALLOWING, "allowing.toml", "sm_90a")["k"]
    assert exp.frame_limit({"tp": 16, "partial": True}, "b") == (16, "measured")
    assert exp.frame_limit({"tp": 16, "partial": False}, "b") == (0, "spills and local arrays")
    assert exp.frame_limit({"tp": 8, "partial": True}, "b")[0] == 0
    with pytest.raises(UsageError, match="selects on tag 'partial'"):
        exp.frame_limit({"tp": 16}, "b")


@pytest.mark.parametrize(
    "allowance, message",
    [
        ('{ max_frame_bytes = 16, why = "m" }', "non-empty `when`"),
        ('{ when = {}, max_frame_bytes = 16, why = "m" }', "non-empty `when`"),
        ('{ when = { tp = 16 }, max_frame_bytes = -1, why = "m" }', "non-negative integer"),
        ("{ when = { tp = 16 }, max_frame_bytes = 16 }", "needs a `why`"),
        ('{ when = { tp = 16 }, max_frame_bytes = 16, why = "m", speed = 1 }', "unknown key 'speed'"),
    ],
)
def test_malformed_frame_allowances_are_one_line_usage_errors(allowance, message):
    text = GOOD.replace("max_frame_bytes = 0\n", f"max_frame_bytes = 0\nframe_allowances = [{allowance}]\n", 1)
    with pytest.raises(UsageError, match=re.escape(message)) as err:
        parse_expectations(text, "bad.toml", "sm_90a")
    assert "\n" not in str(err.value)


def _rule(**kw) -> Rule:
    defaults = {"where": "ptx", "pattern": re.compile(r"ld\.global", re.M), "why": "w"}
    return Rule(**{**defaults, **kw})


def test_rules_count_before_an_anchor_and_against_tag_sums():
    text = "ld.global a\nld.global b\ngriddepcontrol.wait;\nld.global c\n"
    tags = {"weights": 2, "rows": 1, "mix": True}
    before = _rule(count="weights", before=re.compile(r"griddepcontrol\.wait"))
    assert [(c.value, c.passed) for c in before.checks(text, tags, "b")] == [(2, True)]
    total = _rule(count="weights + rows")
    assert total.checks(text, tags, "b")[0].passed
    assert not _rule(count="weights").checks(text, tags, "b")[0].passed  # 3 matches, 2 expected
    bounded = _rule(min=1, max=2)
    assert [c.passed for c in bounded.checks(text, tags, "b")] == [True, False]
    missing_anchor = _rule(count=0, before=re.compile("nowhere"))
    (check,) = missing_anchor.checks(text, tags, "b")
    assert not check.passed and "nowhere" in check.name


def test_rules_select_builds_by_tags_and_reject_unknown_tags():
    rule = _rule(max=0, when={"mix": True})
    assert rule.applies({"mix": True}, "b") and not rule.applies({"mix": False}, "b")
    with pytest.raises(UsageError, match="tag 'mix'"):
        rule.applies({}, "b")
    assert tag_sum("a + 2 + flag", {"a": 3, "flag": True}, "b") == 6
    with pytest.raises(UsageError, match="integer tag 'name'"):
        tag_sum("name", {"name": "attn"}, "b")


# --- the command on fake build sets ---------------------------------------------------------------------------

PTX = ".version 8.8\n.target {arch}\n{body}\n"


@dataclass(frozen=True)
class FakeBuild:
    name: str
    loads: int = 2
    registers: int = 32
    frame: int = 0
    arch_in_ptx: str | None = None  # None: the requested arch
    error: str | None = None
    kernel: str = "k"
    contracted_butterfly: bool = False  # a warp-reduction step fused into an FMA (lanes end with different sums)

    @property
    def tags(self) -> dict[str, int | bool | str]:
        return {"loads": self.loads, "mix": self.loads > 1}

    def compile(self, arch: str) -> KernelArtifacts:
        if self.error:
            raise RuntimeError(f"{self.error}\nsecond line of a long compiler message")
        body = "\n".join(["ld.global.v4.b32 {%r1}, [%rd1];"] * self.loads)
        if self.contracted_butterfly:
            body += "\nshfl.sync.bfly.b32 %r3, %r2, 16, 31, -1;\nfma.rn.f32 %r4, %r1, %r1, %r3;"
        ptx = PTX.format(arch=self.arch_in_ptx or arch, body=body)
        return KernelArtifacts(ptx, make_cubin({"kern": (self.registers, self.frame)}), "LDG.E.128\n" * self.loads)


@dataclass(frozen=True)
class FakeSet:
    items: tuple[FakeBuild, ...]
    text: str = GOOD
    why_missing: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    archs: tuple[str, ...] = ("sm_90a",)
    expectations_name: str = "fake.toml"

    def environment(self, arch: str) -> Mapping[str, str]:
        return self.env

    def missing(self) -> str | None:
        return self.why_missing

    def expectations_text(self) -> str:
        return self.text

    def builds(self, arch: str) -> list[FakeBuild]:
        return list(self.items)


GREEN = FakeSet((FakeBuild("k/b1"), FakeBuild("k/b8", loads=3)))
RED = FakeSet(
    (
        FakeBuild("k/ok"),
        FakeBuild("k/spills", frame=16),
        FakeBuild("k/fat", registers=96),
        FakeBuild("k/wrong-arch", arch_in_ptx="sm_100a"),
        FakeBuild("k/broken", error="ptxas fatal: something"),
        FakeBuild("k/racy-reduction", contracted_butterfly=True),
    )
)
NO_TOOLCHAIN = FakeSet(GREEN.items, why_missing="the toolchain is not installed — pip install 'pkg[extra]'")
UNCHECKED = FakeSet((FakeBuild("other/b1", kernel="other"),))
ESCAPING = FakeSet((FakeBuild("../outside"),))
WITH_ENV = FakeSet(GREEN.items, env={"K3GATE_TEST_TOOLCHAIN_ARCH": "sm_90a"})
LISTS_COUNT_TAG_IT_LACKS = FakeSet(GREEN.items, text=GOOD.replace('count = "loads"', 'count = "stores"'))


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["build", "--arch", "sm_90a", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_green_builds_pass_and_keep_their_artifacts(tmp_path, capsys):
    code, out, err = run(capsys, "--builds", f"{MODULE}:GREEN", "--out", str(tmp_path), "--json")
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and [b["build"] for b in report["builds"]] == ["k/b1", "k/b8"]
    assert json.loads(out)["subjects"]["GREEN"]["ok"] is True
    b8 = report["builds"][1]
    assert b8["resources"]["registers"] == 32 and b8["tags"]["loads"] == 3
    names = {c["name"] for c in b8["checks"]}
    assert {"compiles", "ptx .target", "registers", "local-memory frame bytes"} <= names
    assert (tmp_path / "k/b8/kernel.ptx").read_text().count("ld.global") == 3
    assert (tmp_path / "k/b8/kernel.cubin").read_bytes().startswith(b"\x7fELF")
    assert "2 of 2 builds passed" in err


def test_every_kind_of_violation_fails_the_command(tmp_path, capsys):
    code, _, err = run(capsys, "--builds", f"{MODULE}:RED", "--out", str(tmp_path))
    assert code == 1
    report = {b["build"]: b for b in json.loads((tmp_path / "report.json").read_text())["builds"]}
    failed = {name: [c["name"] for c in b["checks"] if not c["passed"]] for name, b in report.items()}
    assert failed == {
        "k/ok": [],
        "k/spills": ["local-memory frame bytes"],
        "k/fat": ["registers"],
        "k/wrong-arch": ["ptx .target"],
        "k/broken": ["compiles"],
        "k/racy-reduction": ["butterfly steps contracted into FMAs"],
    }
    broken = next(c for c in report["k/broken"]["checks"] if c["name"] == "compiles")
    assert broken["detail"] == "RuntimeError: ptxas fatal: something"  # one line of the compiler's message
    assert "1 of 6 builds passed" in err and "registers (96 <= 64)" in err


def test_a_stricter_expectations_file_fails_builds_that_pass_their_own(tmp_path, capsys):
    strict = tmp_path / "strict.toml"
    strict.write_text(GOOD.replace('count = "loads"', "max = 1"))
    code, _, err = run(
        capsys, "--builds", f"{MODULE}:GREEN", "--out", str(tmp_path / "o"), "--expectations", str(strict)
    )
    assert code == 1 and "0 of 2 builds passed" in err


def test_parallel_compiles_give_the_same_report(tmp_path, capsys):
    run(capsys, "--builds", f"{MODULE}:RED", "--out", str(tmp_path / "one"))
    code, _, _ = run(capsys, "--builds", f"{MODULE}:RED", "--out", str(tmp_path / "two"), "--jobs", "2")
    assert code == 1

    def verdicts(folder: str) -> list:
        report = json.loads((tmp_path / folder / "report.json").read_text())
        return [(b["build"], [(c["name"], c["passed"]) for c in b["checks"]]) for b in report["builds"]]

    assert verdicts("one") == verdicts("two")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--builds", f"{MODULE}:NO_TOOLCHAIN"], "pip install 'pkg[extra]'"),
        (["--builds", f"{MODULE}:UNCHECKED"], "kernel 'other' has no [sm_90a.other] table in fake.toml"),
        (["--builds", f"{MODULE}:ESCAPING"], "is not a relative path"),
        (["--builds", f"{MODULE}:LISTS_COUNT_TAG_IT_LACKS"], "integer tag 'stores'"),
        (["--builds", f"{MODULE}:GREEN", "--match", "nothing/*"], "no kernel build matches 'nothing/*'"),
        (["--builds", f"{MODULE}:GREEN", "--expectations", "/nonexistent/e.toml"], "cannot read --expectations"),
        (["--builds", f"{MODULE}:GREEN", "--jobs", "0"], "--jobs must be at least 1"),
        (["--builds", f"{MODULE}:NOT_THERE"], "cannot load it"),
        (["--builds", "no-colon"], "is not MODULE:ATTRIBUTE"),
        (["--subject", "vllm-generic"], "declares no specialized kernels"),
        (["--subject", "no-such-subject"], "unknown subject"),
    ],
)
def test_usage_problems_exit_2_with_one_line(tmp_path, capsys, args, message):
    code, _, err = run(capsys, *args, "--out", str(tmp_path))
    assert code == 2
    assert message in err
    assert err.count("k3gate: error:") == 1 and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "report.json").exists()


def test_unknown_arch_is_a_usage_error(tmp_path, capsys):
    code = main(["build", "--arch", "sm_100a", "--builds", f"{MODULE}:GREEN", "--out", str(tmp_path)])
    assert code == 2 and "builds its kernels for sm_90a, not sm_100a" in capsys.readouterr().err


def test_the_toolchain_environment_is_set_before_the_toolchain_is_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("K3GATE_TEST_TOOLCHAIN_ARCH", "unset")  # restored after the test
    code, _, _ = run(capsys, "--builds", f"{MODULE}:WITH_ENV", "--out", str(tmp_path))
    assert code == 0 and os.environ["K3GATE_TEST_TOOLCHAIN_ARCH"] == "sm_90a"


def test_list_names_the_builds_without_compiling(capsys):
    code, out, _ = run(capsys, "--builds", f"{MODULE}:RED", "--list", "--match", "k/[ob]*")
    assert code == 0 and out.split() == ["RED:", "k/ok", "RED:", "k/broken"]


def test_the_command_registers_under_kernels_build():
    parser = argparse.ArgumentParser()
    kernels_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kernels", "build", "--arch", "sm_90a", "--subject", "k3-hopper", "--jobs", "2"])
    assert args.fn is kernels_cmd.cmd_kernels_build and args.jobs == 2 and args.subject == "k3-hopper"
    with pytest.raises(SystemExit):  # --subject and --builds exclude each other
        parser.parse_args(["kernels", "build", "--arch", "a", "--subject", "s", "--builds", "m:x"])


def test_subjects_take_part_through_kernel_builds(monkeypatch):
    class WithKernels:
        name = "with"

        def kernel_builds(self):
            return GREEN

    class Without:
        name = "without"

    adapters = {"with": WithKernels(), "without": Without()}
    monkeypatch.setattr(kernels_cmd, "subject_names", lambda: sorted(adapters))
    monkeypatch.setattr(kernels_cmd, "load_subject", adapters.__getitem__)
    assert kernels_cmd._build_sets(None, None) == [("with", GREEN)]  # every subject that declares kernels
    with pytest.raises(UsageError, match="'without' declares no specialized kernels"):
        kernels_cmd._build_sets("without", None)


def test_reports_name_artifacts_relative_to_the_output_folder(tmp_path):
    """The report names artifacts relative to the output folder, never by machine path."""
    result = kernels_cmd.judge(
        FakeBuild("k/b1"),
        "sm_90a",
        FakeBuild("k/b1").compile("sm_90a"),
        "",
        parse_expectations(GOOD, "g", "sm_90a")["k"],
        tmp_path,
    )
    assert result.ok and result.files == ["k/b1/kernel.ptx", "k/b1/kernel.cubin", "k/b1/kernel.sass"]
    assert str(tmp_path) not in json.dumps(result.to_json())
    assert Path(tmp_path, "k/b1/kernel.sass").read_text().count("LDG") == 2
