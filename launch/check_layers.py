#!/usr/bin/env python3
"""The layering check: every #include in src/ must stay within its folder's layer.

launch/layers.txt says which folders of src/ the files of each folder may include
from (besides their own); this script reads every file under src/, resolves each
#include of a project header to its folder and prints one line per include the
table does not allow:

  src/comm/grad_sync.h:12: #include "nn/parameters.h": folder comm may not include nn (allowed: core backend ...)

It also fails when the table's edges form a cycle, when a folder of src/ has no row,
and when an exception no longer matches an include (remove it). Exit status 1 on
any of those, 0 otherwise. Run by launch/test.sh before the build, and by ctest
(tests/CMakeLists.txt: `layers`, and `layers_self_test`, which plants violations
in a scratch tree and checks that they are reported).

  launch/check_layers.py [--src DIR] [--table FILE]
  launch/check_layers.py --self-test
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def parse_table(path):
    """Returns (allowed: folder -> set of folders, order: folders in table order,
    exceptions: list of (file, header, line number))."""
    allowed, order, exceptions = {}, [], []
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("exception "):
                parts = line.split()
                if len(parts) != 3:
                    sys.exit(f"{path}:{n}: expected `exception <file under src/> <header>`, got: {raw.strip()}")
                exceptions.append((parts[1], parts[2], n))
                continue
            folder, sep, rest = line.partition(":")
            folder = folder.strip()
            if not sep or not folder or " " in folder:
                sys.exit(f"{path}:{n}: expected `folder: folders it may include`, got: {raw.strip()}")
            if folder in allowed:
                sys.exit(f"{path}:{n}: folder {folder} has a second row")
            allowed[folder] = set(rest.split())
            order.append(folder)
    for folder in order:
        for dep in sorted(allowed[folder]):
            if dep not in allowed:
                sys.exit(f"{path}: folder {folder} may include {dep}, which has no row")
    return allowed, order, exceptions


def find_cycle(allowed, order):
    """A cycle of the allowed edges as a list of folders, or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(folder, path):
        state[folder] = 1
        path.append(folder)
        for dep in sorted(allowed[folder]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, path)
                if cycle:
                    return cycle
        path.pop()
        state[folder] = 2
        return None

    for folder in order:
        if folder not in state:
            cycle = visit(folder, [])
            if cycle:
                return cycle
    return None


def layer_of(rel):
    """The table row of a path under src/: its first folder, or the file name of a
    file directly in src/ (src/moetrain.h)."""
    return rel.split("/", 1)[0]


def target_of(src, rel_file, header, known):
    """The path under src/ of an included header, or None when it is not ours
    (system and third-party headers)."""
    if header.startswith(("./", "../")) or "/" not in header:
        candidate = os.path.normpath(os.path.join(os.path.dirname(rel_file), header))
        if os.path.exists(os.path.join(src, candidate)):
            return candidate.replace(os.sep, "/")
    if layer_of(header) in known:
        return header
    return None


def check(src, table):
    allowed, order, exceptions = parse_table(table)
    problems = []
    cycle = find_cycle(allowed, order)
    if cycle:
        problems.append(f"{table}: the allowed edges form a cycle: {' -> '.join(cycle)}")

    known = set(allowed)
    entries = sorted(os.listdir(src))
    for name in entries:
        if name not in known and (os.path.isdir(os.path.join(src, name)) or name.endswith((".h", ".cuh"))):
            problems.append(f"{src}/{name}: no row in {table}; add one saying what it may include")
            known.add(name)  # its own includes are still checked below, against nothing
            allowed.setdefault(name, set())

    used_exceptions = set()
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for fname in sorted(filenames):
            path = os.path.join(dirpath, fname)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            if rel == "CMakeLists.txt" or not rel.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            folder = layer_of(rel)
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    target = target_of(src, rel, m.group(2), known)
                    if target is None:
                        continue
                    dep = layer_of(target)
                    if dep == folder or dep in allowed.get(folder, set()):
                        continue
                    hit = next((e for e in exceptions if e[0] in (rel, f"src/{rel}") and e[1] == target), None)
                    if hit:
                        used_exceptions.add(hit)
                        continue
                    shown = f"{m.group(1)}{m.group(2)}{'>' if m.group(1) == '<' else chr(34)}"
                    allowed_text = " ".join(d for d in order if d in allowed.get(folder, set())) or "nothing"
                    problems.append(f"{src}/{rel}:{n}: #include {shown}: folder {folder} may not include {dep} "
                                    f"(allowed: {allowed_text})")
    for e in exceptions:
        if e not in used_exceptions:
            problems.append(f"{table}:{e[2]}: exception {e[0]} -> {e[1]} matches no include any more; remove it")
    return problems


def run(src, table, out=sys.stdout):
    problems = check(src, table)
    for p in problems:
        print(p, file=out)
    if problems:
        print(f"layers: {len(problems)} problem(s); the layers are in {table} (docs/architecture.md)", file=out)
        return 1
    print(f"layers: every #include under {src}/ follows {table}", file=out)
    return 0


def self_test():
    """Plants violations in a scratch tree and checks that each is reported."""
    import io

    def tree(files, table):
        d = tempfile.mkdtemp(prefix="layers-")
        for rel, text in files.items():
            p = os.path.join(d, "src", rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)
        with open(os.path.join(d, "layers.txt"), "w") as f:
            f.write(table)
        return d

    table = "core:\nops: core\nnn: core ops\nexception src/ops/b.cpp nn/c.h  # planted\n"
    clean = {"core/a.h": '#include <vector>\n#include "core/x.h"\n', "core/x.h": "",
             "ops/b.cpp": '#include "core/a.h"\n#include "nn/c.h"\n#include "b_kernels.h"\n#include "fmt/format.h"\n',
             "ops/b_kernels.h": "", "nn/c.h": '#include "ops/b_kernels.h"\n'}
    checks = []

    def expect(name, files, table_text, rc, *lines):
        d = tree(files, table_text)
        src, tab = os.path.join(d, "src"), os.path.join(d, "layers.txt")
        out = io.StringIO()
        got_rc = run(src, tab, out)
        text = out.getvalue()
        shutil.rmtree(d)
        ok = got_rc == rc and all(line.replace("SRC", src).replace("TABLE", tab) in text for line in lines)
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        if not ok:
            print(f"     exit {got_rc} (expected {rc}); output:\n" + text)

    expect("a clean tree passes", clean, table, 0, "every #include")
    planted = dict(clean)
    planted["core/a.h"] = '#include <vector>\n#include "ops/b_kernels.h"  // planted\n'
    expect("a planted violation is reported", planted, table, 1,
           'SRC/core/a.h:2: #include "ops/b_kernels.h": folder core may not include ops (allowed: nothing)')
    planted = dict(clean)
    planted["core/f.h"] = '#include "../nn/c.h"\n#include <ops/b_kernels.h>\n'
    planted["ops/e.cpp"] = '#include "nn/c.h"\n'  # the exception is for ops/b.cpp only
    expect("relative and <> includes, and an exception's other files, are checked", planted, table, 1,
           'SRC/core/f.h:1: #include "../nn/c.h": folder core may not include nn (allowed: nothing)',
           'SRC/core/f.h:2: #include <ops/b_kernels.h>: folder core may not include ops (allowed: nothing)',
           'SRC/ops/e.cpp:1: #include "nn/c.h": folder ops may not include nn (allowed: core)')
    cyclic = table.replace("core:\n", "core: nn\n")
    expect("a cycle in the table is reported", clean, cyclic, 1,
           "TABLE: the allowed edges form a cycle: core -> nn -> core")
    stale = dict(clean)
    stale["ops/b.cpp"] = '#include "core/a.h"\n'
    expect("a stale exception is reported", stale, table, 1,
           "TABLE:4: exception src/ops/b.cpp -> nn/c.h matches no include any more; remove it")
    unlisted = dict(clean)
    unlisted["train/t.cpp"] = '#include "nn/c.h"\n'
    expect("a folder without a row is reported", unlisted, table, 1, "SRC/train: no row in TABLE")
    return 0 if all(checks) else 1


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=os.path.join(root, "src"))
    ap.add_argument("--table", default=os.path.join(root, "launch", "layers.txt"))
    ap.add_argument("--self-test", action="store_true", help="check the checker on planted violations")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    src = os.path.relpath(a.src) if not os.path.relpath(a.src).startswith("..") else a.src
    table = os.path.relpath(a.table) if not os.path.relpath(a.table).startswith("..") else a.table
    return run(src, table)


if __name__ == "__main__":
    sys.exit(main())
