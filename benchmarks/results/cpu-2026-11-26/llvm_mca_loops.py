"""How llvm-mca.txt was made: one function's inner vector loop from a shared library, through llvm-mca.

    python llvm_mca_loops.py LIBRARY FUNCTION_REGEX CPU[,CPU...] [--must=MNEMONIC] [-v]

The loop is the innermost backward branch of the function (objdump -d -C) whose body has at least six
vector instructions, preferring 512-bit over 256-bit ones and then the most vector instructions;
--must=MNEMONIC keeps only loops containing that instruction (the L2 norm's vcvtps2pd, so that its
lane-folding loop is not taken instead). Needs objdump and llvm-mca-14 on PATH.
"""

from __future__ import annotations

import re
import subprocess
import sys


def loop_body(library: str, pattern: str, must: str | None) -> list[str]:
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True)
    functions = re.split(r"\n(?=[0-9a-f]+ <)", dis.stdout)
    function = next(f for f in functions if re.search(pattern, f.split("\n")[0]))
    lines = [ln for ln in function.split("\n")[1:] if re.match(r"\s+[0-9a-f]+:\s", ln)]
    ins = [(int(ln.split(":")[0], 16), ln.split(":", 1)[1].strip()) for ln in lines]
    loops = []
    for addr, text in ins:
        m = re.match(r"(j\w+)\s+([0-9a-f]+)", text)
        if m and m.group(1) != "jmp" and int(m.group(2), 16) < addr:
            loops.append((int(m.group(2), 16), addr))
    best = None
    for start, end in loops:
        if any(start <= s2 and e2 < end for s2, e2 in loops if (s2, e2) != (start, end)):
            continue  # not innermost
        body = [t for a, t in ins if start <= a <= end]
        if must and not any(must in t for t in body):
            continue
        width = 3 if any("zmm" in t for t in body) else 2 if any("ymm" in t for t in body) else 1
        vector = sum(("xmm" in t or "ymm" in t or "zmm" in t) for t in body)
        if vector >= 6 and (best is None or (width, vector) > best[0]):
            best = ((width, vector), body)
    assert best is not None, f"no vector loop in {pattern}"
    body = [re.sub(r"\s+#.*", "", re.sub(r"\s+<.*>", "", t)) for t in best[1]]
    return [re.sub(r"^(j\w+)\s+[0-9a-f]+", r"\1 .Lloop", t) for t in body]


def main() -> None:
    library, pattern, cpus = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    must = next((a.removeprefix("--must=") for a in sys.argv if a.startswith("--must=")), None)
    body = loop_body(library, pattern, must)
    print(f"{len(body)} instructions in the loop")
    if "-v" in sys.argv:
        print("\n".join(body))
    asm = ".Lloop:\n" + "\n".join(body) + "\n"
    for cpu in cpus:
        out = subprocess.run(["llvm-mca-14", f"-mcpu={cpu}", "-iterations=200"], input=asm, capture_output=True,
                             text=True)
        summary = dict(re.findall(r"(Total uOps|Block RThroughput|Total Cycles):\s+([\d.]+)", out.stdout))
        print(cpu, summary or out.stderr.strip().splitlines()[:1])


if __name__ == "__main__":
    main()
