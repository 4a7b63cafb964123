"""What one thread of a PTX kernel stores, as expressions: a check that two builds compute the same values.

Two builds of a kernel that claim the same arithmetic (a variant that only skips discarded work, or moves when a
copy is issued) must store the same values at the same addresses, bit for bit. A GPU test compares their outputs
on one set of inputs; this compares their PTX on the CPU, for every input at once. One thread is run at a time:
integer registers hold concrete values (its thread and block indices are given, kernel parameters and the shared
memory base become distinct constants), so addresses and branches on them are exact; loaded words and floating
point values stay symbolic, each a hash-consed expression (`a * b + c` fused by the source is `fma(a, b, c)`,
never an `add` of a `mul`), so two stores are equal only if the same operations combine the same loaded words in
the same order; only the two operands of an add or a multiply (an fma's factors) may swap, which changes no bit.
Values are bytes: a store of a packed word stores its halves, halves of a loaded word are the narrower loads, and a
64-bit address sum of symbolic values is the same address in any grouping. A branch on a symbolic value (a loaded
slot, a flag) is reported and not taken, in both builds.

Synchronization and inline-assembly blocks that write no kernel register (barrier waits, bulk copies) define no
values and are skipped; a block that does write one (a wgmma's accumulators) is an error. A shared load reads a
symbol of its address, unless `compare(follow_copies=True)` finds the byte staged by one bulk copy from global
memory (`staging`): then it reads that global byte. The run is linear in the instructions executed; a loop whose
bound is symbolic is cut at `max_steps`, and that is an error, never "equal". Not checked here: whether barriers
order what they must (racecheck and the GPU tests do).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

MAX_STEPS = 200_000  # instructions one thread may run before the run is an error
PARAM_STRIDE = 1 << 20  # kernel parameter i reads as the constant (i + 1) * PARAM_STRIDE + its byte offset
# Operations that define nothing a store can depend on (ordering, prefetches; bulk copies stage shared memory, see
# staging).
NO_VALUE = {
    "bar",
    "barrier",
    "fence",
    "membar",
    "griddepcontrol",
    "cp",
    "prefetch",
    "red",
    "applypriority",
    "discard",
    "createpolicy",
    "setmaxnreg",
    "nanosleep",
    "trap",
}
INT_OPS = {
    "add",
    "sub",
    "mul",
    "mad",
    "shl",
    "shr",
    "and",
    "or",
    "xor",
    "not",
    "selp",
    "setp",
    "cvt",
    "min",
    "max",
    "neg",
    "mov",
    "rem",
    "div",
    "cvta",
    "mapa",
}
FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f64"}


class PtxValueError(ValueError):
    """The PTX holds something this reader cannot run: an operation on integers it does not know, a runaway loop."""


@dataclass(frozen=True)
class Expr:
    """A symbolic value: an operation over arguments (expressions, integers or names), identified by its hash."""

    op: str
    args: tuple
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        parts = [self.op] + [a.key if isinstance(a, Expr) else repr(a) for a in self.args]
        object.__setattr__(self, "key", hashlib.sha1("|".join(parts).encode()).hexdigest()[:16])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expr) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def brief(self, depth: int = 4) -> str:
        if depth == 0:
            return "…"
        inner = ", ".join(a.brief(depth - 1) if isinstance(a, Expr) else repr(a) for a in self.args)
        return f"{self.op}({inner})"


Value = int | Expr
Address = tuple  # ("abs", int) for a concrete address, ("sym", key, offset) for one computed from a loaded value


@dataclass
class ThreadRun:
    """What one thread stored, the symbolic branches it did not take, and how many instructions it ran (labels and
    skipped predicated ones not counted): a build's work per thread, comparable between builds of one kernel."""

    stores: dict[tuple[str, Address], Value]
    untaken: list[str]
    executed: int = 0


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@dataclass(frozen=True)
class _Inst:
    op: str
    operands: tuple[str, ...]
    pred: str | None


_Program = tuple[list[_Inst], dict[str, int]]


def parse(ptx: str) -> _Program:
    """The first kernel's instructions (an inline-assembly block is one "asm" instruction whose operands are the
    kernel registers it writes) and its labels. A statement may span lines (mma.sync's operand lists)."""
    start = ptx.find(".entry")
    if start < 0:
        raise PtxValueError("no .entry in the PTX: not a kernel")
    body = ptx[ptx.index("{", start) + 1 :]
    insts: list[_Inst] = []
    labels: dict[str, int] = {}
    asm: list[str] | None = None
    pending = ""
    for raw in body.split("\n"):
        line = raw.split("//")[0].strip()
        if not line:
            continue
        if asm is None and line == "}" and not pending:
            break  # the kernel's closing brace
        if asm is not None:
            if line.startswith("}"):
                insts.append(_Inst("asm", tuple(_asm_outputs(asm)), None))
                asm = None
            else:
                asm.append(line)
            continue
        if line.startswith("{") and not line.startswith("{%") and not pending:
            asm = []
            continue
        if line.endswith(":") and not pending:
            labels[line[:-1].strip()] = len(insts)
            continue
        if line.startswith(".") and not pending:
            continue
        pending = f"{pending} {line}".strip()
        if not pending.endswith(";"):
            continue  # the statement goes on on the next line
        text, pending = pending[:-1].strip(), ""
        pred = None
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        op, _, rest = text.partition(" ")
        insts.append(_Inst(op, tuple(_split_operands(rest)), pred))
    return insts, labels


def _asm_outputs(lines: list[str]) -> list[str]:
    """The kernel registers (%-named) an inline-assembly block writes: the first operand of an instruction that
    is a register or a register list, not an address. Its own registers (declared in the block) are not listed."""
    out = []
    for line in lines:
        if line.startswith(".") or line.endswith(":"):
            continue
        text = line.rstrip(";").strip()
        if text.startswith("@"):
            text = text.split(None, 1)[1] if " " in text else ""
        first = _split_operands(text.partition(" ")[2])[:1]
        out += [r for r in _register_list(first[0]) if r.startswith("%")] if first else []
    return out


def _followed_copy(op: str) -> bool:
    """A bulk copy from global into shared memory by address (not a tensor copy through a tensor map, nor one inside
    a braced inline-assembly block, which no kernel here emits: what those stage stays a shared load)."""
    return op.startswith("cp.async.bulk.shared") and ".global" in op and ".tensor" not in op


def _register_list(tok: str) -> list[str]:
    """The registers of "{%r1, %r2}" or the one of "%r1"."""
    return [t.strip() for t in tok.strip().strip("{}").split(",") if t.strip()]


def _signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _int_op(op: str, a: list[int]) -> int:
    parts = op.split(".")
    name = parts[0]
    types = [t for t in parts[1:] if re.fullmatch(r"[bsu](8|16|32|64)", t)]
    bits = int(types[-1][1:]) if types else 32  # the operands' type (cvt: the source's, and types[0] the result's)
    mask = (1 << bits) - 1
    signed = bool(types) and types[-1].startswith("s")

    def s(x: int) -> int:
        return _signed(x, bits) if signed else x & mask

    if name == "mov":
        return a[0] & mask
    if name in ("add", "sub"):
        return (a[0] + a[1] if name == "add" else a[0] - a[1]) & mask
    if name == "neg":
        return -a[0] & mask
    if name in ("mul", "mad"):
        extra = a[2] if name == "mad" else 0
        if "wide" in parts:
            x, y = (_signed(a[0], bits), _signed(a[1], bits)) if signed else (a[0] & mask, a[1] & mask)
            return (x * y + extra) & ((1 << (2 * bits)) - 1)
        if "hi" in parts:
            return ((s(a[0]) * s(a[1])) >> bits) & mask
        return (a[0] * a[1] + extra) & mask
    if name == "shl":
        return (a[0] << a[1]) & mask
    if name == "shr":
        return (s(a[0]) >> a[1]) & mask
    if name in ("and", "or", "xor"):
        return {"and": a[0] & a[1], "or": a[0] | a[1], "xor": a[0] ^ a[1]}[name] & mask
    if name == "not":
        return ~a[0] & mask
    if name in ("min", "max"):
        return (min if name == "min" else max)(s(a[0]), s(a[1])) & mask
    if name == "selp":
        return a[0] if a[2] else a[1]
    if name == "setp":
        x, y = s(a[0]), s(a[1])
        tests = {
            "eq": x == y,
            "ne": x != y,
            "lt": x < y,
            "le": x <= y,
            "gt": x > y,
            "ge": x >= y,
            "lo": x < y,
            "ls": x <= y,
            "hi": x > y,
            "hs": x >= y,
        }
        return int(tests[parts[1]])
    if name == "cvt":  # cvt.<result>.<source>: the source's bits, sign-extended if signed, cut to the result's
        return (_signed(a[0], bits) if signed else a[0] & mask) & ((1 << int(types[0][1:])) - 1)
    if name == "cvta":
        return a[0]
    if name == "mapa":  # the peer CTA's window of the same shared address
        return a[0] | (a[1] << 24)
    if name in ("rem", "div"):  # C's: the quotient rounds toward zero
        x, y = s(a[0]), s(a[1])
        q = abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)
        return (x - q * y if name == "rem" else q) & mask
    raise PtxValueError(f"integer operation {op} is not known to harness.ptx_values")


def _is_int_op(op: str) -> bool:
    parts = op.split(".")
    if parts[0] not in INT_OPS:
        return False
    if parts[0] == "setp":
        return not any(t in FLOAT_TYPES for t in parts[2:])
    return not any(t in FLOAT_TYPES or t in ("rn", "rz", "rm", "rp", "ftz", "approx", "sat") for t in parts[1:])


def _affine(op: str, args: list[Value]) -> Expr | int | None:
    """A 64-bit add, subtract, shift or multiply by a constant over symbolic integers, as a sum of terms (an opaque
    symbolic value times a coefficient) plus a constant, all modulo 2^64, where the ring's laws make every order of
    the same sum one value: so `(slot * K + a) + b` and `slot * K + (a + b)` address the same byte. None for any
    other operation (and for 32-bit ones, whose wrap-around a later widening would not commute with)."""
    name, mask = op.split(".")[0], (1 << 64) - 1
    if (
        not re.search(r"\.[bsu]64\b", op)
        or ".wide" in op
        or ".hi" in op
        or name not in ("add", "sub", "shl", "mul", "mad")
    ):
        return None

    def terms(v: Value) -> tuple[dict[str, tuple[Expr, int]], int]:
        if isinstance(v, int):
            return {}, v
        if v.op == "affine":
            return {atom.key: (atom, coef) for atom, coef in v.args[0]}, v.args[1]
        return {v.key: (v, 1)}, 0

    def scaled(t: tuple[dict, int], k: int) -> tuple[dict, int]:
        return {key: (atom, coef * k & mask) for key, (atom, coef) in t[0].items()}, t[1] * k & mask

    def added(a: tuple[dict, int], b: tuple[dict, int]) -> tuple[dict, int]:
        out = dict(a[0])
        for key, (atom, coef) in b[0].items():
            out[key] = (atom, (out[key][1] + coef if key in out else coef) & mask)
        return out, (a[1] + b[1]) & mask

    parts = [terms(a) for a in args]
    if name in ("add", "sub"):
        total = added(parts[0], scaled(parts[1], mask) if name == "sub" else parts[1])
    elif name == "shl" and isinstance(args[1], int):
        total = scaled(parts[0], 1 << (args[1] & 63))
    elif name in ("mul", "mad") and (isinstance(args[0], int) or isinstance(args[1], int)):
        k, other = (args[0], parts[1]) if isinstance(args[0], int) else (args[1], parts[0])
        total = scaled(other, k)
        if name == "mad":
            total = added(total, parts[2])
    else:
        return None
    kept = tuple(sorted(((atom, coef) for atom, coef in total[0].values() if coef), key=lambda t: t[0].key))
    return Expr("affine", (kept, total[1])) if kept else total[1]


def _commuted(op: str, args: list[Value]) -> tuple:
    """The arguments of a floating-point add, multiply or fma in one order: the GPU's a + b and b + a (a * b, b * a)
    have the same bits, NaN included (a result NaN is the canonical one), and the compiler may emit either."""
    name = op.split(".")[0]
    if name in ("add", "mul", "fma") and set(op.split(".")[1:]) & FLOAT_TYPES and len(args) >= 2:
        first = sorted(args[:2], key=lambda a: a.key if isinstance(a, Expr) else repr(a))
        return (*first, *args[2:])
    return tuple(args)


def _width(op: str) -> int:
    """Bytes of one element of a load or store."""
    return 8 if re.search(r"\.[bsuf]64", op) else 2 if re.search(r"\.[bsuf]16", op) else 4


def _element(addr: Address, i: int, width: int) -> Address:
    return (*addr[:-1], addr[-1] + i * width)


class _Thread:
    """One thread's registers and stores while it runs a parsed kernel."""

    def __init__(self, tid: int, ctaid: tuple[int, int, int]) -> None:
        self.special = {
            "%tid.x": tid,
            "%tid.y": 0,
            "%tid.z": 0,
            "%laneid": tid % 32,
            "%ctaid.x": ctaid[0],
            "%ctaid.y": ctaid[1],
            "%ctaid.z": ctaid[2],
        }
        self.regs: dict[str, Value] = {}
        self.stores: dict[tuple[str, Address], Value] = {}
        self.untaken: list[str] = []
        self.copies: list[tuple[int, int, int]] = []  # (shared address, global address, bytes) this thread issued
        self.staged: dict[int, tuple[int, float]] = {}  # shared byte -> (global byte, first epoch stored): staging
        self.epoch = 0  # block-wide barriers passed
        self.shared_writes: list[tuple[int, int, int]] = []  # (shared address, bytes, epoch) of this thread's stores

    def value(self, tok: str) -> Value:
        tok = tok.strip()
        if tok in self.special:
            return self.special[tok]
        if tok.startswith("%"):
            return self.regs.get(tok, Expr("unset", (tok,)))
        if re.fullmatch(r"0[fd][0-9A-Fa-f]+", tok):
            return Expr("const", (tok,))
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return int(tok, 0) & ((1 << 64) - 1)
        return 0  # a symbol's address (the shared memory base): every build's shared memory starts at 0

    def address(self, tok: str) -> Address:
        inner = tok.strip()[1:-1].replace(" ", "")
        if "_param_" in inner:
            name, _, off = inner.rpartition("_param_")[2].partition("+")
            return ("abs", (int(name) + 1) * PARAM_STRIDE + int(off or 0))
        m = re.fullmatch(r"([%\w]+)?(?:\+(-?\d+))?", inner)
        if m is None:
            raise PtxValueError(f"address {tok} is not [reg+offset]")
        base = self.value(m.group(1)) if m.group(1) else 0
        off = int(m.group(2) or 0)
        if isinstance(base, Expr) and base.op == "affine":  # the symbolic terms, and every constant in the offset
            return ("sym", Expr("affine", (base.args[0], 0)).key, _signed(base.args[1] + off, 64))
        return ("sym", base.key, off) if isinstance(base, Expr) else ("abs", base + off)

    def run(self, insts: list[_Inst], labels: dict[str, int], max_steps: int) -> ThreadRun:
        pc = steps = executed = 0
        while pc < len(insts):
            steps += 1
            if steps > max_steps:
                raise PtxValueError(f"more than {max_steps} instructions run: a loop on a symbolic bound?")
            inst = insts[pc]
            pc += 1
            op, ops = inst.op, inst.operands
            if op == "asm":
                if ops:  # e.g. a wgmma's accumulators: values this reader cannot follow, so never "equal"
                    raise PtxValueError(f"inline assembly writes {', '.join(ops[:3])}: not run by harness.ptx_values")
                continue
            if inst.pred is not None:
                p = self.value(inst.pred.lstrip("@!"))
                negate = inst.pred.startswith("@!")
                if isinstance(p, Expr):
                    if op.startswith("bra"):
                        self.untaken.append(f"{inst.pred} {op} {ops[0]} on {p.brief(2)}")
                        continue
                    if _followed_copy(op):
                        continue  # a copy that may not happen stages nothing
                    before = self.regs.get(ops[0]) if ops else None
                    self.execute(op, ops)
                    if ops and ops[0] in self.regs:
                        kept = before if before is not None else 0
                        self.regs[ops[0]] = Expr("select", (p, negate, self.regs[ops[0]], kept))
                    continue
                if bool(p) == negate:
                    continue
            executed += 1
            if op.startswith("bra"):
                pc = labels[ops[0]]
            elif op in ("ret", "exit"):
                break
            else:
                self.execute(op, ops)
        return ThreadRun(self.stores, self.untaken, executed)

    def execute(self, op: str, ops: tuple[str, ...]) -> None:
        regs, value = self.regs, self.value
        name = op.split(".")[0]
        if _followed_copy(op):
            self.copy(ops)
            return
        if op.startswith(("bar.sync", "barrier.sync", "barrier.cluster.wait")) and len(ops) <= 1:
            self.epoch += 1  # every thread of the block passes it (a named barrier with a count is not counted)
        if name in NO_VALUE or not ops:  # no operands (a wgmma fence, a cluster barrier): no value either
            return
        if name in ("mbarrier", "atom", "elect"):  # a token or an old value: opaque, never a stored value's input here
            if ops and ops[0].startswith("%"):
                regs[ops[0].strip("{}").split(",")[0].strip()] = Expr(op, tuple(ops[1:]))
            return
        if name == "st":
            addr, width = self.address(ops[0]), _width(op)
            space = op.split(".")[1]
            for i, v in enumerate(ops[1].strip("{}").split(",")):
                at, stored = _element(addr, i, width), value(v)
                if isinstance(stored, Expr) and stored.op == "pack":  # its parts at their own bytes, as narrower
                    for j, part in enumerate(stored.args):  # stores of them would put them: memory is bytes
                        self.stores[(space, _element(at, j, width // len(stored.args)))] = part
                else:
                    self.stores[(space, at)] = stored
                if space == "shared" and addr[0] == "abs":
                    self.shared_writes.append((addr[1] + i * width, width, self.epoch))
            return
        if name == "ld":
            addr = self.address(ops[1])
            for i, dst in enumerate(d.strip() for d in ops[0].strip("{}").split(",")):
                where = _element(addr, i, _width(op))
                regs[dst] = where[1] if "param" in op else Expr("ld." + op.split(".")[1], (where, _width(op)))
                if op.startswith("ld.shared") and where[0] == "abs":
                    staged = [self.staged.get(where[1] + b, (None, 0)) for b in range(_width(op))]
                    source = [g for g, stored in staged if stored > self.epoch]
                    if len(source) == len(staged) and source == list(range(source[0], source[0] + len(source))):
                        regs[dst] = Expr("ld.global", (("abs", source[0]), _width(op)))  # what the copy brought
            return
        dst = ops[0]
        if dst.startswith("{") and name != "mov":  # several results (mma.sync): each a function of every input
            inputs = tuple(value(r) for o in ops[1:] for r in _register_list(o))
            for i, d in enumerate(_register_list(dst)):
                regs[d] = Expr(op, (i, *inputs))
            return
        bits = 64 if ".b64" in op or ".u64" in op else 32
        if dst.startswith("{"):  # an unpack: {lo, hi} of a 32- or 64-bit register
            src, parts = value(ops[1]), _register_list(dst)
            width = bits // len(parts)
            for i, d in enumerate(parts):
                if isinstance(src, int):
                    regs[d] = (src >> (width * i)) & ((1 << width) - 1)
                elif src.op.startswith("ld."):  # part of a loaded word is what a narrower load there would read
                    regs[d] = Expr(src.op, (_element(src.args[0], i, width // 8), width // 8))
                else:
                    regs[d] = Expr("half", (i, src))
            return
        if len(ops) > 1 and ops[1].startswith("{") and name == "mov":  # a pack
            parts = [value(p) for p in _register_list(ops[1])]
            width = bits // len(parts)
            if all(isinstance(p, int) for p in parts):
                regs[dst] = sum(p << (width * i) for i, p in enumerate(parts))
            else:
                regs[dst] = Expr("pack", tuple(parts))
            return
        args = [value(r) for o in ops[1:] for r in _register_list(o)]
        concrete = all(isinstance(a, int) for a in args)
        if not concrete and (folded := _affine(op, args)) is not None:
            regs[dst] = folded
        elif concrete and _is_int_op(op):
            regs[dst] = _int_op(op, args)
        elif name == "mov" and len(args) == 1:
            regs[dst] = args[0]
        elif name == "shfl" and ".idx" in op and isinstance(args[0], int):
            regs[dst] = args[0]  # an integer broadcast: the kernel broadcasts values uniform over the warp
        elif concrete and not set(op.split(".")[1:]) & FLOAT_TYPES and name != "shfl":
            raise PtxValueError(f"integer operation {op} is not known to harness.ptx_values")
        else:
            regs[dst] = Expr(op, _commuted(op, args))

    def copy(self, ops: tuple[str, ...]) -> None:
        dst, src = self.address(ops[0]), self.address(ops[1])
        size = self.value(ops[2])
        if dst[0] == "abs" and src[0] == "abs" and isinstance(size, int):
            self.copies.append((dst[1], src[1], size))


def staging(ptx: str, program: _Program, ctaid: tuple[int, int, int]) -> dict[int, tuple[int, float]]:
    """Shared byte -> (global byte, the first barrier epoch in which a thread stores to it), from the bulk copies
    every thread of the block (`.reqntid`) issues, for bytes exactly one copy writes. A shared load of such a byte
    before that epoch reads global's byte, once the copy has landed: the kernel's barriers order that, and
    racecheck and the GPU tests check them, not this. A store in a later epoch comes after the load (a block-wide
    barrier lies between them), so memory reused for an exchange is followed until it is reused; a byte two copies
    write (a ring refilled) stays a shared load."""
    insts, labels = program
    if not any(_followed_copy(i.op) for i in insts):
        return {}
    header = re.search(r"\.entry[^{]*", ptx)
    threads = re.search(r"\.reqntid\s+(\d+)", header.group(0) if header else "")
    if threads is None:
        raise PtxValueError("the kernel has no .reqntid: its threads, whose copies stage shared memory, are unknown")
    written: dict[int, int] = {}
    twice: set[int] = set()
    stored: dict[int, int] = {}
    for tid in range(int(threads.group(1))):
        run = _Thread(tid, ctaid)
        run.run(insts, labels, MAX_STEPS)
        for dst, src, size in run.copies:
            for b in range(size):
                if dst + b in written and written[dst + b] != src + b:
                    twice.add(dst + b)
                written[dst + b] = src + b
        for start, size, epoch in run.shared_writes:
            for b in range(start, start + size):
                stored[b] = min(epoch, stored.get(b, epoch))
    return {a: (g, stored.get(a, math.inf)) for a, g in written.items() if a not in twice}


def run_thread(ptx: str, tid: int, ctaid: tuple[int, int, int], max_steps: int = MAX_STEPS) -> ThreadRun:
    """Run thread `tid` of block `ctaid` of the PTX's kernel; see the module docstring."""
    return run_threads(ptx, [tid], ctaid, max_steps)[0]


def run_threads(ptx: str, tids: list[int], ctaid: tuple[int, int, int], max_steps: int = MAX_STEPS) -> list[ThreadRun]:
    """run_thread for each of `tids`, the kernel parsed once."""
    program = parse(ptx)
    return [_Thread(tid, ctaid).run(*program, max_steps) for tid in tids]


@dataclass(frozen=True)
class StoreDifference:
    thread: int
    space: str
    address: Address
    mine: str
    theirs: str

    def __str__(self) -> str:
        return f"thread {self.thread}: {self.space} store at {self.address}: {self.mine} against {self.theirs}"


def compare(
    ptx: str, other: str, threads: list[int], ctaid: tuple[int, int, int] = (1, 2, 3), follow_copies: bool = False
) -> list[StoreDifference]:
    """The stores where the two kernels' threads differ: an address only one stores to, or a different value.
    `follow_copies`: a shared load of a byte a bulk copy staged is global's byte (`staging`), so a build that stages
    what the other loads directly can compare equal; it runs every thread of the block once more per kernel."""
    return compare_groups(ptx, other, [([t], [t]) for t in threads], ctaid, follow_copies)


def compare_groups(
    ptx: str,
    other: str,
    groups: list[tuple[list[int], list[int]]],
    ctaid: tuple[int, int, int] = (1, 2, 3),
    follow_copies: bool = False,
) -> list[StoreDifference]:
    """`compare` for builds that split the work between their threads differently: per group, what the first
    kernel's threads store together against what the other's do (a difference names the group's first thread).
    Two threads of one group storing different values at one address is an error: their order is not this tool's
    to know."""
    programs = parse(ptx), parse(other)
    staged = [staging(p, prog, ctaid) if follow_copies else {} for p, prog in zip((ptx, other), programs, strict=True)]
    out = []
    for group in groups:
        runs = []
        for program, copies, tids in zip(programs, staged, group, strict=True):
            together: dict[tuple[str, Address], Value] = {}
            for tid in tids:
                thread = _Thread(tid, ctaid)
                thread.staged = copies
                for key, value in thread.run(*program, MAX_STEPS).stores.items():
                    if together.setdefault(key, value) != value:
                        raise PtxValueError(f"threads {tids} store two values at {key}: which lands is not known")
            runs.append(together)
        mine, theirs = runs
        for key in sorted(set(mine) | set(theirs), key=repr):
            a, b = mine.get(key), theirs.get(key)
            if a != b:
                show = [x.brief() if isinstance(x, Expr) else repr(x) for x in (a, b)]
                out.append(StoreDifference(group[0][0], key[0], key[1], *show))
    return out
