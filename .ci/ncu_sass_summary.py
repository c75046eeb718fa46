"""Where a kernel's time goes, instruction by instruction, from Nsight Compute's source
page (`ncu -i REPORT --page source --csv --print-source sass > FILE.csv`, a report taken
with `--set full`): for each kernel, its stall reasons over all warp samples; its code
in runs of instructions executed equally often (a loop's body runs as often as its
trips: the runs tell a prologue from a loop from an epilogue) with each run's share of
the samples; and its hottest instructions with their top stall reasons. Usage:
python .ci/ncu_sass_summary.py FILE.csv [HOTTEST]"""
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path):
    """(kernel name, header, rows) for each kernel of the CSV."""
    found = []
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            found.append([row[1], None, []])
        elif row and row[0] == "Address" and found:
            found[-1][1] = row
        elif found and found[-1][1] and len(row) > 5:
            found[-1][2].append(row)
    return found


def summary(name, header, rows, hottest):
    column = {key: i for i, key in enumerate(header)}

    def number(row, key):
        try:
            return float(row[column[key]].replace(",", "") or 0)
        except (KeyError, ValueError):
            return 0.0

    stalls = [key for key in header if key.startswith("stall_") and "Not Issued" not in key]
    total = sum(number(row, SAMPLES) for row in rows)
    executed = sum(number(row, "Instructions Executed") for row in rows)
    print(f"== {name[:110]}")
    print(f"   {len(rows)} instructions, {total:.0f} samples, {executed:.0f} warp instructions executed")
    reasons = collections.Counter({key[len('stall_'):]: sum(number(row, key) for row in rows) for key in stalls})
    print("   stalls: " + ", ".join(f"{key} {value:.0f}" for key, value in reasons.most_common(8)))
    runs = []  # [first, last, executions, samples]
    for i, row in enumerate(rows):
        times, samples = number(row, "Instructions Executed"), number(row, SAMPLES)
        if runs and runs[-1][2] == times:
            runs[-1][1], runs[-1][3] = i, runs[-1][3] + samples
        else:
            runs.append([i, i, times, samples])
    by_count = collections.Counter()
    for first, last, times, samples in runs:
        by_count[times] += samples
    print("   samples by times executed: " + ", ".join(
        f"{times:.0f}x {samples:.0f} ({100 * samples / max(total, 1):.0f}%)" for times, samples in by_count.most_common(6)))
    for first, last, times, samples in runs:
        if samples >= 0.02 * total:
            print(f"   [{first:5d}-{last:5d}] executed {times:7.0f}x  samples {samples:5.0f} ({100 * samples / total:.0f}%)")
    print("   hottest:")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -number(rows[i], SAMPLES))[:hottest]):
        row = rows[i]
        top = sorted(((number(row, key), key[len('stall_'):]) for key in stalls), reverse=True)[:3]
        print(f"   {i:5d} {number(row, SAMPLES):5.0f}  {row[1][:56]:56s} x{number(row, 'Instructions Executed'):.0f}  "
              + " ".join(f"{key}:{value:.0f}" for value, key in top if value))


if __name__ == "__main__":
    for name, header, rows in kernels(sys.argv[1]):
        summary(name, header, rows, int(sys.argv[2]) if len(sys.argv) > 2 else 20)
