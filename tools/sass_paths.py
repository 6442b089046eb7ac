"""A static reading of SASS control flow: a kernel's hot loop and the instructions on its fast path.

Reads ``nvdisasm -g -c`` output (labels, branch targets and each instruction's source line), builds the
control-flow graph of each function, finds its loops and, for the hot loop (the vector loop: the one
with the most 128-bit global stores), the fast path from the loop's head back to it: the path an
iteration takes when every data-dependent branch goes the common way (see fast_path). Used by
tools/gpu_budgets.py for its per-element counts; no GPU needed.

The classification of opcodes (integer/logic, floating point, shared loads, global loads) follows the
SASS instruction set reference (CUDA binary utilities, "Instruction Set Reference" for Ampere and Hopper).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|\$[\w$.]+|[A-Za-z_]\w*):\s*$")
_SECTION = re.compile(r"^//-+ \.text\.(\S+)\s+-+$")
_FILE = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
_TARGET = re.compile(r"`\(([^)]+)\)")


@dataclass
class Instr:
    offset: int
    pred: str  # "" or the guard, e.g. "@!P0"
    opcode: str  # with its modifiers, e.g. "LDG.E.128"
    operands: str
    file: str = ""
    line: int = 0

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def target(self) -> str | None:
        m = _TARGET.search(self.operands)
        return m.group(1) if m else None


@dataclass
class Function:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> index of the instruction it names


def parse_nvdisasm(text: str) -> dict[str, Function]:
    """``nvdisasm -g -c`` output -> {kernel name: Function} (subroutines stay labels inside their kernel)."""
    funcs: dict[str, Function] = {}
    fn: Function | None = None
    file, line = "", 0
    for raw in text.splitlines():
        if m := _SECTION.match(raw):
            fn = funcs.setdefault(m.group(1), Function(m.group(1)))
            file, line = "", 0
        elif fn is None:
            continue
        elif m := _FILE.match(raw):
            file, line = m.group(1), int(m.group(2))
        elif m := _LABEL.match(raw):
            fn.labels[m.group(1)] = len(fn.instrs)
        elif m := _INSTR.match(raw):
            pred = (m.group(2) or "").strip()
            fn.instrs.append(Instr(int(m.group(1), 16), pred, m.group(3), m.group(4), file, line))
    return funcs


# ---- Opcode classes ---------------------------------------------------------------------------------
# Integer and logic work on the integer pipes (and the uniform datapath's integer ops); moves are not.
_INT_BASES = {
    "IADD3", "IADD", "IMAD", "IMUL", "IABS", "IMNMX", "ISETP", "ISCADD", "LOP3", "LOP", "SHF", "SHL", "SHR",
    "LEA", "PRMT", "SEL", "SGXT", "BMSK", "BREV", "FLO", "POPC", "VIADD", "VIMNMX", "VIADDMNMX", "IDP", "I2I",
    "PLOP3", "P2R", "R2P", "BFE", "BFI", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "USEL", "UPRMT", "UISETP",
    "UIMNMX", "USGXT", "UBMSK", "UBREV", "UFLO", "UPOPC", "UPLOP3", "ULOP", "USHL", "USHR", "UP2UR",
}  # fmt: skip
_MOVE_OPCODES = ("IMAD.MOV", "IMAD.U32")  # IMAD.MOV.U32 R, RZ, RZ, x and IMAD.U32 R, RZ, RZ, UR: moves
_FP_PREFIXES = ("FADD", "FMUL", "FFMA", "FSETP", "FSET", "FMNMX", "FSEL", "FCHK", "FRND", "F2F", "F2I", "F2FP",
                "FSWZADD", "MUFU", "DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "HADD2", "HMUL2", "HSETP2", "HMNMX2",
                "I2F", "I2FP")  # fmt: skip


def is_int_logic(i: Instr) -> bool:
    if i.opcode.startswith(_MOVE_OPCODES) and "RZ, RZ" in i.operands:
        return False
    return i.base in _INT_BASES


def is_fp(i: Instr) -> bool:
    """Floating-point arithmetic, comparisons and conversions (HFMA2.MMA with zero operands is a move)."""
    if i.base == "HFMA2":
        return "-RZ, RZ" not in i.operands
    return i.base in _FP_PREFIXES


def is_shared_load(i: Instr) -> bool:
    return i.base == "LDS"


def is_global_load(i: Instr) -> bool:
    return i.base == "LDG"


def is_global_store(i: Instr) -> bool:
    return i.base in ("STG", "RED", "ATOMG")


def access_bits(i: Instr) -> int:
    """Bits moved by one global/shared access from its modifiers (.128, .64, .U16, .U8, ...)."""
    mods = set(i.opcode.split(".")[1:])
    for bits, names in ((128, {"128"}), (64, {"64"}), (16, {"U16", "S16"}), (8, {"U8", "S8"})):
        if mods & names:
            return bits
    return 32


# ---- Control flow -----------------------------------------------------------------------------------
@dataclass
class Block:
    start: int  # instruction indices [start, end)
    end: int
    succs: list[int] = field(default_factory=list)


class Cfg:
    """Basic blocks of one function and their successors (a call falls through)."""

    def __init__(self, fn: Function) -> None:
        self.fn = fn
        ins = fn.instrs
        leaders = {0} | {i for i in fn.labels.values() if i < len(ins)}
        for k, i in enumerate(ins):
            if i.base in ("BRA", "EXIT", "RET", "BRX", "JMX", "JMP") and k + 1 < len(ins):
                leaders.add(k + 1)
        starts = sorted(leaders)
        self.blocks = [Block(s, e) for s, e in zip(starts, [*starts[1:], len(ins)])]
        self.block_at = {b.start: n for n, b in enumerate(self.blocks)}
        for n, b in enumerate(self.blocks):
            last = ins[b.end - 1]
            falls = n + 1 < len(self.blocks)
            never = last.pred in ("@!PT", "@!UPT")
            always = last.pred in ("", "@PT", "@UPT")
            if last.base in ("BRX", "JMX"):
                raise ValueError(f"{fn.name}: indirect branch at {last.offset:#x}")
            if last.opcode.startswith("BRA.DIV"):
                # Taken only when the warp has diverged (to a fallback for a warp collective): a fast-path
                # iteration runs converged, so only the fall-through counts.
                b.succs.append(n + 1)
            elif last.base in ("BRA", "JMP") and not never:
                target = last.target
                if target is None or target not in fn.labels:
                    raise ValueError(f"{fn.name}: branch target of {last.opcode} at {last.offset:#x} not found")
                b.succs.append(self.block_at[fn.labels[target]])
                if not always and falls:
                    b.succs.append(n + 1)
            elif last.base in ("EXIT", "RET") and always:
                pass
            elif falls:
                b.succs.append(n + 1)

    def cost(self, n: int) -> int | None:
        """Instructions of block n (NOPs aside), or None when it calls a subroutine unconditionally: nvcc's
        division and square-root slow paths are calls, which the fast path never takes."""
        b = self.blocks[n]
        instrs = [i for i in self.fn.instrs[b.start : b.end] if i.base != "NOP"]
        if any(i.base == "CALL" and not i.pred for i in instrs):
            return None
        return len(instrs)

    def back_edges(self) -> list[tuple[int, int]]:
        """(tail, head) of every edge to a block on the depth-first path from the entry (iterative DFS)."""
        edges, state = [], {0: 1}  # 1: on the path, 2: done
        stack = [(0, iter(self.blocks[0].succs))]
        while stack:
            n, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[n] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                edges.append((n, nxt))
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(self.blocks[nxt].succs)))
        return edges

    def loops(self) -> dict[int, set[int]]:
        """{head: body blocks} of each natural loop (back edges to one head merged)."""
        preds: dict[int, list[int]] = {n: [] for n in range(len(self.blocks))}
        for n, b in enumerate(self.blocks):
            for s in b.succs:
                preds[s].append(n)
        out: dict[int, set[int]] = {}
        for tail, head in self.back_edges():
            body = out.setdefault(head, {head})
            work = [tail]
            while work:
                n = work.pop()
                if n not in body:
                    body.add(n)
                    work.extend(preds[n])
        return out


@dataclass
class LoopPath:
    """The fast path of one loop: its instructions in program order, from the head back to it."""

    head_offset: int
    body_blocks: int
    nested: bool  # the loop contains another loop (its fast path then runs the inner body once)
    instrs: list[Instr]


def _instructions(cfg: Cfg, blocks: Iterable[int]) -> list[Instr]:
    return [i for n in blocks for i in cfg.fn.instrs[cfg.blocks[n].start : cfg.blocks[n].end] if i.base != "NOP"]


def fast_path(cfg: Cfg, head: int, body: set[int]) -> list[int]:
    """The blocks of the fast path around a loop: of the paths head -> ... -> a back edge to head within the
    body that call no subroutine, the one with the most instructions. In these kernels a data-dependent
    branch either skips work for special values (a NaN's code, an all-zero block, a block deferred to
    the general path) or calls a slow path, so the path that does all the ordinary work and no slow-path
    call is what an iteration on ordinary data runs. The body is a DAG once the back edges are dropped:
    relaxed in reverse depth-first finishing order."""
    back = set(cfg.back_edges())
    order, seen = [], {head}
    stack = [(head, iter(cfg.blocks[head].succs))]
    while stack:
        n, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(n)
            stack.pop()
        elif nxt in body and nxt not in seen and (n, nxt) not in back:
            seen.add(nxt)
            stack.append((nxt, iter(cfg.blocks[nxt].succs)))
    head_cost = cfg.cost(head)
    if head_cost is None:
        raise ValueError(f"{cfg.fn.name}: the loop head at {cfg.fn.instrs[cfg.blocks[head].start].offset:#x} calls")
    dist, prev = {head: head_cost}, {head: -1}
    best_tail, best = -1, -1
    for n in reversed(order):
        if n not in dist:
            continue
        for s in cfg.blocks[n].succs:
            if s == head and (n, head) in back:
                if dist[n] > best:
                    best, best_tail = dist[n], n
            elif s in body and (n, s) not in back and (c := cfg.cost(s)) is not None and dist[n] + c > dist.get(s, -1):
                dist[s], prev[s] = dist[n] + c, n
    if best_tail < 0:
        raise ValueError(f"{cfg.fn.name}: no call-free path around the loop at {cfg.blocks[head].start}")
    path, n = [], best_tail
    while n >= 0:
        path.append(n)
        n = prev[n]
    return path[::-1]


def hot_loop(fn: Function) -> LoopPath:
    """The vector loop (the one whose body has the most 128-bit global stores; then the most stores, then
    the smallest body) and its fast path."""
    cfg = Cfg(fn)
    loops = cfg.loops()
    if not loops:
        raise ValueError(f"{fn.name}: no loop")

    def rank(h: int) -> tuple[int, int, int]:
        stores = [i for i in _instructions(cfg, loops[h]) if is_global_store(i)]
        return sum(access_bits(i) == 128 for i in stores), len(stores), -len(loops[h])

    head = max(loops, key=rank)
    body = loops[head]
    nested = any(h != head and h in body for h in loops)
    blocks = fast_path(cfg, head, body)
    return LoopPath(fn.instrs[cfg.blocks[head].start].offset, len(body), nested, _instructions(cfg, blocks))


@dataclass
class PathCounts:
    """What one fast path does, in SASS instructions (divide by the elements it handles for per-element)."""

    instructions: int
    int_logic: int
    shared_loads: int
    global_loads: int
    global_stores: int
    fp: int
    loads_first: bool  # every global load precedes the first floating-point instruction
    stored_bits: dict[int, int]  # access width -> global stores of that width
    in_lines: int = 0  # instructions attributed to the source ranges asked for (see count_path)


def count_path(instrs: list[Instr], lines: dict[str, list[tuple[int, int]]] | None = None) -> PathCounts:
    """Counts of a path; ``lines``: {source file suffix: [(first, last) line ranges]} whose instructions
    are also counted (``in_lines``: e.g. the Philox generator's)."""
    first_fp = next((k for k, i in enumerate(instrs) if is_fp(i)), len(instrs))
    last_ldg = max((k for k, i in enumerate(instrs) if is_global_load(i)), default=-1)
    stored: dict[int, int] = {}
    for i in instrs:
        if is_global_store(i):
            stored[access_bits(i)] = stored.get(access_bits(i), 0) + 1
    in_lines = 0
    for i in instrs:
        for suffix, ranges in (lines or {}).items():
            if i.file.endswith(suffix) and any(a <= i.line <= b for a, b in ranges):
                in_lines += 1
                break
    return PathCounts(
        instructions=len(instrs), int_logic=sum(map(is_int_logic, instrs)),
        shared_loads=sum(map(is_shared_load, instrs)), global_loads=sum(map(is_global_load, instrs)),
        global_stores=sum(map(is_global_store, instrs)),
        fp=sum(map(is_fp, instrs)), loads_first=last_ldg < first_fp, stored_bits=stored, in_lines=in_lines,
    )  # fmt: skip


def function_ranges(source: str, pattern: str) -> list[tuple[int, int]]:
    """(first, last) 1-based lines of each function definition in ``source`` whose name matches ``pattern``
    (a regex): from the line naming it to its closing brace."""
    lines = source.splitlines()
    out = []
    name = re.compile(rf"\b(?:{pattern})\s*\(")
    k = 0
    while k < len(lines):
        text = lines[k]
        m = name.search(text)
        before = text[: m.start()] if m else ""
        if m and before.strip() and not re.search(r"[=(]|//|\breturn\b", before) and not text.rstrip().endswith(";"):
            depth, seen, j = 0, False, k
            while j < len(lines):
                code = lines[j].split("//")[0]
                depth += code.count("{") - code.count("}")
                seen = seen or "{" in code
                if seen and depth <= 0:
                    break
                if not seen and code.rstrip().endswith(";"):  # a declaration or a call
                    j = -1
                    break
                j += 1
            if j >= 0 and seen:
                out.append((k + 1, j + 1))
                k = j
        k += 1
    return out
