"""The README's main job against a hand-written script of the same network and epochs (issue 66's
goal: the tool ≤ 1.25x the script).

    python bench/main_job.py --rounds 3 [--quick]

runs, in turns, (a) the `pipeline.py ...` part of the README's first command (its own flags; its
--output_model and --report_json moved into a scratch folder) and (b) its twin: a plain script,
written to a scratch file, that does what a user would write by hand for the same result: load
scikit-learn's digits (/16, as the tool reads `builtin:digits`), the tool's stratified split
(a literal copy of ttc/inputs/data.py's assign_splits, seed 0), a literal copy of the SmallCNN
the tool builds for 8x8 images (ttc/nets/models.py: widths [32, 64], 2 convs per stage, dropout
0.2), AdamW (3e-3, weight decay 1e-4) under the same warm-up/stable/decay schedule, batches of
64 with the same random 1-pixel shifts, one torch thread, the validation accuracy each epoch and
the best epoch kept; then torch.onnx.export (dynamo, batch axis dynamic, opset 18),
onnx.checker, one numeric check against PyTorch on the test split (max |diff|, top-1
agreement) and the test accuracy in ONNX Runtime (one thread). The twin runs as many epochs as
the tool's run before it did (the tool stops early on --patience), so both train the same number
of epochs. The twin copies the network rather than importing ttc.nets: a hand-written script does
not import the tool.

It prints each one's median wall time, the ratio tool / twin, and the tool's own stage timings
from its report JSON (train, its epochs, export, the pictures, the rest of its clock, and the
time before its clock starts: interpreter and imports). --quick: 1 round, 2 epochs.
"""
from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import REPO, add_quick_flag, scratch_dir

TWIN = r'''
"""A hand-written train + export + check + score script: digits, a small CNN, ONNX Runtime."""
import json
import sys
import time

started = time.perf_counter()
import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

EPOCHS, OUT = int(sys.argv[1]), sys.argv[2]
BATCH, LR, WEIGHT_DECAY, SEED = 64, 3e-3, 1e-4, 0
torch.set_num_threads(1)
torch.manual_seed(SEED)
imported = time.perf_counter()


def assign_splits(labels, val_fraction=0.15, test_fraction=0.15, seed=SEED):
    rng = np.random.default_rng(seed)
    by_class = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    splits = ["train"] * len(labels)
    share = lambda n, f: min(max(1 if n >= 3 else 0, round(n * f)), n - 1)
    for label in sorted(by_class):
        group = by_class[label]
        order = rng.permutation(len(group))
        n_test = share(len(group), test_fraction)
        n_val = share(len(group) - n_test, val_fraction / (1 - test_fraction))
        for rank, position in enumerate(order):
            splits[group[position]] = ("test" if rank < n_test else
                                       "val" if rank < n_test + n_val else "train")
    return np.array(splits)


digits = load_digits()
pixels = (digits.images / 16.0).astype(np.float32)[:, None]
splits = assign_splits([str(int(t)) for t in digits.target])
data = {s: (torch.from_numpy(pixels[splits == s]), torch.from_numpy(digits.target[splits == s]))
        for s in ("train", "val", "test")}
x, y = data["train"]
mean, std = x.mean().item(), x.std().item()


class SmallCNN(nn.Module):
    def __init__(self, widths=(32, 64), num_classes=10, dropout=0.2):
        super().__init__()
        self.register_buffer("mean", torch.tensor([mean]).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor([std]).view(1, -1, 1, 1))
        layers, channels = [], 1
        for stage, width in enumerate(widths):
            if stage > 0:
                layers.append(nn.MaxPool2d(2))
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False),
                           nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, pixels):
        z = self.features((pixels - self.mean) / self.std).mean(dim=(2, 3))
        return self.classifier(self.dropout(z))


class WithProbabilities(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, image):
        logits = self.net(image)
        return logits, torch.softmax(logits, dim=-1)


def random_shift(batch, generator):
    n, _, height, width = batch.shape
    shifts = torch.randint(-1, 2, (n, 2), generator=generator).float()
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, 0, 2] = -2.0 * shifts[:, 0] / width
    theta[:, 1, 2] = -2.0 * shifts[:, 1] / height
    grid = F.affine_grid(theta, list(batch.shape), align_corners=False)
    return F.grid_sample(batch, grid, mode="nearest", padding_mode="border", align_corners=False)


def schedule(total):
    warmup, decay = max(1, round(0.05 * total)), max(1, round(0.2 * total))
    stable_until = max(warmup, total - decay)
    return lambda step: ((step + 1) / warmup if step < warmup else 1.0 if step < stable_until
                         else max(0.0, (total - step) / decay))


net = SmallCNN()
optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
steps = len(x) // BATCH + (len(x) % BATCH > 1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(EPOCHS * steps))
generator = torch.Generator().manual_seed(SEED)
best, best_state = -1.0, None
for epoch in range(1, EPOCHS + 1):
    net.train()
    order = torch.randperm(len(x), generator=generator)
    for i in range(0, len(x) - 1, BATCH):
        batch = order[i:i + BATCH]
        loss = F.cross_entropy(net(random_shift(x[batch], generator)), y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    net.eval()
    with torch.no_grad():
        accuracy = (net(data["val"][0]).argmax(1) == data["val"][1]).float().mean().item()
    if accuracy >= best:
        best, best_state = accuracy, {k: v.clone() for k, v in net.state_dict().items()}
net.load_state_dict(best_state)
trained = time.perf_counter()

model = WithProbabilities(net).eval()
x_test, y_test = data["test"]
program = torch.onnx.export(model, (x_test[:64],), input_names=["image"],
                            output_names=["logits", "probabilities"], opset_version=18,
                            dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True)
program.save(OUT)
exported = time.perf_counter()

onnx.checker.check_model(onnx.load(OUT), full_check=True)
options = ort.SessionOptions()
options.intra_op_num_threads = options.inter_op_num_threads = 1
session = ort.InferenceSession(OUT, options, providers=["CPUExecutionProvider"])
logits = session.run(["logits"], {"image": x_test.numpy()})[0]
with torch.no_grad():
    expected = net(x_test).numpy()
max_diff = float(np.abs(logits - expected).max())
agreement = float((logits.argmax(1) == expected.argmax(1)).mean())
assert max_diff < 1e-3 and agreement == 1.0, (max_diff, agreement)
accuracy = float((logits.argmax(1) == y_test.numpy()).mean())
done = time.perf_counter()
print(json.dumps({"epochs": EPOCHS, "val_accuracy": best, "test_accuracy": accuracy,
                  "max_abs_diff": max_diff, "top1_agreement": agreement,
                  "seconds": {"imports": imported - started, "data + train": trained - imported,
                              "export": exported - trained, "check + score": done - exported}}))
'''


@dataclass
class Run:
    wall: float
    cpu: float  # user + system seconds of the process
    result: dict  # the tool's report, or the twin's printed summary


def timed(command: list[str], what: str) -> tuple[float, float, str]:
    """Run `command`; its wall and CPU seconds and its stdout. A failed run stops the bench
    with its last lines of stderr."""
    cpu_before, started = children_cpu(), time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - started, children_cpu() - cpu_before
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n" +
                 "\n".join(proc.stderr.splitlines()[-5:]))
    return wall, cpu, proc.stdout


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def readme_command() -> list[str]:
    """The `pipeline.py ...` part of the README's first bash command, as words."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(next(part for part in block.split("&&") if "pipeline.py" in part))
    return words[next(i for i, w in enumerate(words) if w.endswith("pipeline.py")):]


def readme_main_job(folder: Path) -> list[str]:
    """The README's main job with its output paths moved into `folder`."""
    words = readme_command()
    moved = {"--output_model": folder / "model.onnx", "--report_json": folder / "report.json"}
    for flag, path in moved.items():
        words[words.index(flag) + 1] = str(path)
    return [str(REPO / words[0]), *words[1:]]


def run_tool(folder: Path, extra: list[str]) -> Run:
    wall, cpu, _ = timed([sys.executable, *readme_main_job(folder), *extra], "the main job")
    return Run(wall, cpu, json.loads((folder / "report.json").read_text(encoding="utf-8")))


def run_twin(script: Path, epochs: int, folder: Path) -> Run:
    wall, cpu, out = timed([sys.executable, str(script), str(epochs), str(folder / "twin.onnx")],
                           "the twin")
    return Run(wall, cpu, json.loads(out.splitlines()[-1]))


def stage_lines(runs: list[Run]) -> list[str]:
    """The tool's own timings from its reports (medians over the runs)."""
    def median(value) -> float:
        return statistics.median(value(r.result) for r in runs)

    train = median(lambda r: r["train"]["seconds"])
    export = median(lambda r: r["export"]["seconds"])
    epochs = median(lambda r: sum(r["train"]["engine"]["epoch_seconds"]))
    visuals = median(lambda r: r.get("seconds_visuals") or 0.0)
    total = median(lambda r: r["seconds_total"])
    before = statistics.median(r.wall - r.result["seconds_total"] for r in runs)
    return [f"  before the tool's clock (interpreter, flags)    {before:6.2f}",
            f"  train (report train.seconds)                    {train:6.2f}",
            f"    of which the epochs (sum of epoch_seconds)    {epochs:6.2f}",
            f"  export (export.seconds)                         {export:6.2f}",
            f"  plots + page (seconds_visuals)                  {visuals:6.2f}",
            f"  the rest of seconds_total (data, torch/DSPy/onnx imports, inference, evaluation)"
            f" {total - train - export - visuals:6.2f}",
            f"  seconds_total                                   {total:6.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, in turns")
    add_quick_flag(parser)
    args = parser.parse_args()
    rounds, extra = (1, ["--epochs", "2"]) if args.quick else (args.rounds, [])
    script = scratch_dir() / "twin.py"
    script.write_text(TWIN, encoding="utf-8")
    tool_runs: list[Run] = []
    twin_runs: list[Run] = []
    for k in range(rounds):  # the tool first in the first round: the twin runs its epochs
        for which in (("tool", "twin") if k % 2 == 0 else ("twin", "tool")):
            folder = scratch_dir()
            if which == "tool":
                tool_runs.append(run_tool(folder, extra))
            else:
                epochs = tool_runs[-1].result["train"]["epochs_run"]
                twin_runs.append(run_twin(script, epochs, folder))
        print(f"round {k + 1}: tool {tool_runs[-1].wall:.2f} s, twin {twin_runs[-1].wall:.2f} s",
              file=sys.stderr)
    report(tool_runs, twin_runs)


def report(tool_runs: list[Run], twin_runs: list[Run]) -> None:
    tool = statistics.median(r.wall for r in tool_runs)
    twin = statistics.median(r.wall for r in twin_runs)
    last_tool, last_twin = tool_runs[-1].result, twin_runs[-1].result
    print("main job: " + shlex.join(readme_command()))
    print(f"wall time, median of {len(tool_runs)} tool and {len(twin_runs)} twin runs in turns (s):"
          f" main job {tool:.2f}, hand-written twin {twin:.2f}; ratio tool/twin {tool / twin:.2f}"
          f" (goal ≤ 1.25: {'met' if tool / twin <= 1.25 else 'NOT met'})")
    cpu_tool = statistics.median(r.cpu for r in tool_runs)
    cpu_twin = statistics.median(r.cpu for r in twin_runs)
    print(f"CPU time (user + system), median (s): main job {cpu_tool:.2f}, twin {cpu_twin:.2f}; "
          f"ratio {cpu_tool / cpu_twin:.2f} (less moved by other jobs on a shared machine)")
    print(f"epochs run: tool {[r.result['train']['epochs_run'] for r in tool_runs]}, twin "
          f"{[r.result['epochs'] for r in twin_runs]}")
    print(f"test accuracy (last run): tool {last_tool['inference']['accuracy']:.4f}, twin "
          f"{last_twin['test_accuracy']:.4f}; max |onnx - torch|: tool "
          f"{last_tool['export']['max_abs_diff']:.2g}, twin {last_twin['max_abs_diff']:.2g}")
    print("the tool's stage timings, median (s):")
    print("\n".join(stage_lines(tool_runs)))
    print("the twin's, median (s): " + ", ".join(
        f"{name} {statistics.median(r.result['seconds'][name] for r in twin_runs):.2f}"
        for name in last_twin["seconds"]) + " (AdamW's torch._dynamo import falls in its training)")


if __name__ == "__main__":
    main()
