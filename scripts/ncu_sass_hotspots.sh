#!/usr/bin/env bash
# Where an attention kernel's warps stall, per SASS instruction (Nsight Compute source page), and the
# tensor-pipe / issue summary of the launch:
#   bash scripts/ncu_sass_hotspots.sh   ->  top instructions and opcodes by stall samples ($OUT/sass.csv)
# KERNEL: kernel-name regex; NCU_CMD: the command to profile (default: one decode benchmark case).
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
NCU_CMD=${NCU_CMD:-python3 benchmarks/bench_decode.py --families c4a --batches 128 --rep 5 --skip-torch --out /tmp/ncu}
ncu --clock-control none --kernel-name regex:"${KERNEL:-_attention_kernel|_sparse_mla_kernel}" --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis -o /tmp/profile -f \
    $NCU_CMD >/dev/null 2>&1
ncu -i /tmp/profile.ncu-rep --page details --csv 2>/dev/null | python3 -c "
import csv, sys
for r in csv.DictReader(sys.stdin):
    name = r.get('Metric Name') or ''
    if any(k in name for k in ('Duration', 'Throughput', 'Issue Slots', 'Tensor', 'Warp Cycles Per Issued', 'Executed Ipc')):
        print(f\"{name[:60]:60s} {r.get('Metric Value', '')} {r.get('Metric Unit', '')}\")
"
# stall reasons: warps stalled per issued instruction, by reason (the WarpStateStats breakdown)
ncu -i /tmp/profile.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) > 2:
    names, values = rows[0], rows[2]
    stalls = [(float(v.replace(',', '') or 0), n.split('issue_stalled_')[1].split('_per_issue_active')[0])
              for n, v in zip(names, values) if 'issue_stalled_' in n and n.endswith('per_issue_active.ratio')]
    print('stall reasons (warps per issued instruction):', ', '.join(f'{r} {v:.2f}' for v, r in sorted(stalls, reverse=True)[:10]))
"
ncu -i /tmp/profile.ncu-rep --page source --print-source sass --csv > "$OUT/sass.csv" 2>/dev/null
python3 - "$OUT/sass.csv" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith('"Kernel Name"')))  # first line: the kernel
if not rows:
    sys.exit("no rows")
cols = rows[0].keys()
samp = next(c for c in cols if "Warp Stall Sampling (All" in c)
src = next(c for c in cols if c.strip() in ("Source", "# Source"))
ex = next((c for c in cols if c.startswith("Instructions Executed")), None)
val = lambda r, c: float((r.get(c) or "0").replace(",", "") or 0)
total = sum(val(r, samp) for r in rows)
print(f"{len(rows)} SASS instructions, {total:.0f} stall samples; executed column: {ex}")
by_op = collections.Counter(); ex_op = collections.Counter()
for r in rows:
    op = r[src].split()[0] if r[src].split() else "?"
    if op.startswith("@"):
        op = r[src].split()[1]
    op = op.split(".")[0]
    by_op[op] += val(r, samp)
    if ex: ex_op[op] += val(r, ex)
print("opcode            stall%   executed")
for op, v in by_op.most_common(25):
    print(f"{op:16s} {100*v/total:6.1f} {ex_op[op]:12.0f}")
print("top instructions:")
addr = next((c for c in cols if c.strip() == "Address"), None)
for r in sorted(rows, key=lambda r: -val(r, samp))[:45]:
    print(f"{100*val(r, samp)/total:5.1f}%  {r.get(addr, '') if addr else ''}  {r[src][:90]}")
PY
