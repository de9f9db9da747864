"""Bring your own network: torchvision backbones (--arch), your own nn.Module (--model_def),
starting weights (--init_weights, --pretrained) and a linear probe first (--freeze_epochs),
each through training, export, validation and the later stages."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import assert_clean_failure, pipeline_bundle, run_cli, write_image_folder

ONE_EPOCH = ["--epochs", "1", "--no_progress", "true"]


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> Path:
    """16×16 grayscale digits 0-2, 30 per class."""
    return write_image_folder(tmp_path_factory.mktemp("byo") / "digits", classes=(0, 1, 2),
                              per_class=30)


@pytest.fixture(scope="module")
def other_digits_folder(tmp_path_factory) -> Path:
    """Other classes (3-6): a run that starts from weights trained on digits_folder."""
    return write_image_folder(tmp_path_factory.mktemp("byo") / "other", classes=(3, 4, 5, 6),
                              per_class=30)


def onnx_probabilities(model: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(["probabilities"], {session.get_inputs()[0].name: x})[0]


# ----------------------------------------------------------------------------- torchvision


@pytest.mark.parametrize("arch,stages", [
    ("resnet18", ["--quantize", "static", "--tta", "true", "--ttt", "true", "--ttt_method",
                  "all", "--eval_shift", "gaussian_noise"]),
    ("mobilenet_v3_small", ["--quantize", "dynamic", "--fp16", "true", "--iterative",
                            "mc_dropout", "--iterations", "4", "--ttt", "true"]),
    # One epoch on 57 images leaves EfficientNet's logits in the hundreds (loss ≈ 12), where
    # float32 rounding over its 80 layers alone passes 1e-4 (measured 9e-4, top-1 agreement
    # 100%): the check then exits 4, rightly. Here the test is that it exports and runs.
    ("efficientnet_b0", ["--iterative", "mc_dropout", "--iterations", "4",
                         "--validate_atol", "1e-2"]),
])
def test_torchvision_archs_run_every_stage(digits_folder, tmp_path, arch, stages):
    out = pipeline_bundle(tmp_path / arch, "--dataset_path", digits_folder, "--arch", arch,
                          *ONE_EPOCH, "--batch_size", "32", *stages)
    report, manifest = out["report"], json.loads((out["dir"] / "model.json").read_text())
    assert report["train"]["arch"] == arch == manifest["architecture"]["torchvision"]
    assert report["train"]["network"] == "TorchvisionNet"
    assert manifest["architecture"]["small_stem"] is True  # 16-pixel images
    assert report["export"]["max_abs_diff"] <= (1e-2 if arch == "efficientnet_b0" else 1e-4)
    assert report["export"]["top1_agreement"] == 1.0
    assert report["inference"]["accuracy"] is not None
    if "--ttt" in stages:
        assert report["ttt"]["clean"]["accuracy_bn"] is not None
    if "mc_dropout" in stages:
        assert report["iterative"]
    if "--quantize" in stages:
        assert report["quantize"]["mode"] in ("static", "dynamic")
    x = np.random.default_rng(0).random((5, 1, 16, 16), dtype=np.float32)
    probabilities = onnx_probabilities(out["model"], x)
    assert probabilities.shape == (5, 3)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)


def test_resnet34_builds_like_resnet18():
    """ResNet-34 is ResNet-18's code with more blocks (resnet18 above runs every stage): built
    with the small stem and one input channel, it maps a batch to one logit per class."""
    import torch

    from ttc.nets.models import TorchvisionNet

    net = TorchvisionNet("resnet34", in_channels=1, num_classes=3, small_stem=True).eval()
    assert net.body.conv1.in_channels == 1 and net.body.conv1.stride == (1, 1)
    assert sum(len(getattr(net.body, f"layer{i}")) for i in range(1, 5)) == 16  # 3+4+6+3 blocks
    with torch.no_grad():
        assert net(torch.rand(2, 1, 16, 16)).shape == (2, 3)


def test_an_imagenet_stem_for_large_images_and_mc_dropout_refused_without_dropout(tmp_path):
    from ttc.nets.models import TorchvisionNet

    net = TorchvisionNet("resnet18", in_channels=3, num_classes=4, small_stem=False)
    assert net.body.conv1.kernel_size == (7, 7) and net.body.conv1.stride == (2, 2)
    assert not isinstance(net.body.maxpool, torch.nn.Identity)
    small = TorchvisionNet("mobilenet_v3_small", in_channels=1, num_classes=4, small_stem=True)
    assert small.body.features[0][0].stride == (1, 1)
    assert small.body.features[0][0].in_channels == 1
    from config import Config
    from ttc.convert.checking import validation_tolerance

    for arch, atol in (("efficientnet_b0", 1e-3), ("resnet18", 1e-4), (None, 1e-4)):
        assert validation_tolerance(Config(), {"architecture": {"arch": arch}}) == atol
    assert validation_tolerance(Config(validate_atol=5e-5),
                                {"architecture": {"arch": "efficientnet_b0"}}) == 5e-5
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--arch", "resnet18",
                  "--iterative", "mc_dropout", "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--arch resnet18 has no Dropout layer")


# ----------------------------------------------------------------------------- --pretrained


def test_pretrained_reads_the_torch_hub_cache_and_never_downloads(digits_folder, tmp_path):
    import torchvision

    home = tmp_path / "torch_home"
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--arch", "resnet18",
                  "--pretrained", "true", *ONE_EPOCH, "--output_model", tmp_path / "a.onnx",
                  extra_env={"TORCH_HOME": str(home)})
    expected = home / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert_clean_failure(run, 3, str(expected), "does not download")
    assert not expected.exists()
    # ImageNet-shaped weights made here (no network), saved under the name torch hub uses
    expected.parent.mkdir(parents=True)
    torch.manual_seed(1)
    imagenet = torchvision.models.resnet18(weights=None)
    torch.save(imagenet.state_dict(), expected)
    out = tmp_path / "pre"
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--arch", "resnet18",
                  "--pretrained", "true", "--freeze_epochs", "1", *ONE_EPOCH, "--output_model",
                  out / "model.onnx", "--report_json", out / "report.json",
                  extra_env={"TORCH_HOME": str(home)})
    assert run.returncode == 0, run.stderr[-3000:]
    init = json.loads((out / "report.json").read_text())["train"]["init_weights"]
    total = len(imagenet.state_dict())
    # the 7×7 RGB stem and the 1000-class head do not fit a 16-pixel, 3-class grayscale net
    assert init["loaded"] == total - 3 and init["tensors_in_file"] == total
    assert sorted(init["skipped_keys"]) == ["conv1.weight", "fc.bias", "fc.weight"]
    assert "body.fc.weight" in init["missing_keys"]
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["architecture"]["normalization"] == "imagenet"
    trained = torch.load(out / "model.pt", weights_only=True)
    # one frozen epoch: the loaded body is unchanged, only the head learned
    np.testing.assert_array_equal(trained["body.layer3.0.conv1.weight"].numpy(),
                                  imagenet.state_dict()["layer3.0.conv1.weight"].numpy())
    assert trained["mean"].flatten().tolist() == pytest.approx([0.449], abs=1e-6)


def test_pretrained_needs_a_torchvision_arch(tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--pretrained", "true",
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--pretrained loads torchvision's ImageNet weights")


# ----------------------------------------------------------------------------- --init_weights


@pytest.fixture(scope="module")
def source_bundle(digits_folder, tmp_path_factory) -> dict:
    return pipeline_bundle(tmp_path_factory.mktemp("source"), "--dataset_path", digits_folder,
                           "--epochs", "2")


def test_init_weights_from_a_bundle_into_other_classes(source_bundle, other_digits_folder,
                                                       tmp_path):
    source = torch.load(source_bundle["dir"] / "model.pt", weights_only=True)
    out = pipeline_bundle(tmp_path / "b", "--dataset_path", other_digits_folder,
                          "--init_weights", source_bundle["dir"] / "model.pt",
                          "--freeze_epochs", "2", "--epochs", "2")
    init = out["report"]["train"]["init_weights"]
    learned = [k for k in source if k not in ("mean", "std")]
    # everything but the head (3 classes there, 4 here) and the data statistics
    assert init["loaded"] == len(learned) - 2
    assert sorted(init["skipped_keys"]) == ["classifier.bias", "classifier.weight", "mean",
                                            "std"]
    assert sorted(init["missing_keys"]) == ["classifier.bias", "classifier.weight"]
    assert any("classifier head" in note for note in init["notes"])
    assert out["report"]["train"]["freeze_epochs"] == 2
    trained = torch.load(out["dir"] / "model.pt", weights_only=True)
    for key in learned:  # frozen for every epoch: the convolutions are the source's
        if key.endswith("weight") and not key.startswith("classifier"):
            np.testing.assert_array_equal(trained[key].numpy(), source[key].numpy(), key)
    assert trained["classifier.weight"].shape == (4, source["classifier.weight"].shape[1])


def test_init_weights_from_safetensors_and_files_that_do_not_fit(source_bundle, digits_folder,
                                                                 tmp_path):
    from safetensors.torch import save_file

    source = torch.load(source_bundle["dir"] / "model.pt", weights_only=True)
    wrapped = tmp_path / "wrapped.safetensors"  # keys as DataParallel writes them
    save_file({f"module.{k}": v.contiguous() for k, v in source.items()}, str(wrapped))
    out = pipeline_bundle(tmp_path / "s", "--dataset_path", digits_folder, "--init_weights",
                          wrapped, *ONE_EPOCH)
    init = out["report"]["train"]["init_weights"]
    assert init["loaded"] == len(source) - 2 and init["missing"] == 0  # same classes: all
    unrelated = tmp_path / "unrelated.safetensors"
    save_file({"encoder.weight": torch.zeros(3, 3)}, str(unrelated))
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--init_weights", unrelated,
                  *ONE_EPOCH, "--output_model", tmp_path / "u.onnx")
    assert_clean_failure(run, 3, "none of the 1 tensors", "encoder.weight [3, 3]")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--init_weights", garbage,
                  *ONE_EPOCH, "--output_model", tmp_path / "g.onnx")
    assert_clean_failure(run, 3, f"cannot read weights {garbage}")
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--init_weights",
                  tmp_path / "absent.pt", "--output_model", tmp_path / "x.onnx")
    assert_clean_failure(run, 3, "--init_weights", "does not exist")
    assert not (tmp_path / "u.onnx").exists() and not (tmp_path / "g.onnx").exists()


# ----------------------------------------------------------------------------- --model_def

MODEL_DEF = '''
import torch
from torch import nn

print("importing mynet")  # a user's print must not reach stdout


class Net(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(channels, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def build(num_classes, input_spec):
    assert input_spec["kind"] == "image" and input_spec["shape"][0] == "batch"
    return Net(input_spec["channels"], num_classes)


def wrong_shape(num_classes, input_spec):
    return Net(input_spec["channels"], num_classes + 1)


def not_a_module(num_classes, input_spec):
    return 42
'''


def test_model_def_through_bn_ttt_tent_and_int8(digits_folder, tmp_path):
    source = tmp_path / "src" / "mynet.py"
    source.parent.mkdir()
    source.write_text(MODEL_DEF)
    out = tmp_path / "bundle"
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--model_def",
                  f"{source}:build", "--epochs", "2", "--no_progress", "true", "--quantize",
                  "static", "--ttt", "true", "--ttt_method", "all", "--eval_shift", "contrast",
                  "--output_model", out / "model.onnx", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)  # stdout is the JSON alone: the module's print went away
    assert "importing mynet" in run.stderr
    assert report["train"]["network"] == "UserNetwork" and report["train"]["arch"] == "model_def"
    assert report["quantize"]["mode"] == "static"
    assert report["ttt"]["clean"]["accuracy_bn"] is not None
    assert report["ttt"]["clean"]["accuracy_tent"] is not None
    manifest = json.loads((out / "model.json").read_text())
    copy = out / manifest["files"]["model_def"]
    assert copy.name == "model.def.py" and copy.read_text() == MODEL_DEF
    assert manifest["architecture"]["model_def"]["factory"] == "build"
    # Tent and export rebuild the module from the bundle's copy (which runs its code: only
    # with --trust_model_code, tests/test_untrusted_files.py): the original may go
    shutil.rmtree(source.parent)
    run = run_cli("inference.py", "--model", out / "model.onnx", "--ttt", "true",
                  "--ttt_method", "tent", "--dataset_path", digits_folder,
                  "--trust_model_code", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    run = run_cli("export.py", "--output_model", out / "model.onnx", "--dataset_path",
                  digits_folder, "--trust_model_code")
    assert run.returncode == 0, run.stderr[-3000:]
    copy.write_text(MODEL_DEF + "\n# edited\n")
    run = run_cli("inference.py", "--model", out / "model.onnx", "--ttt", "true",
                  "--ttt_method", "tent", "--dataset_path", digits_folder,
                  "--trust_model_code", "true")
    assert_clean_failure(run, 4, "model.def.py does not match its manifest")


@pytest.mark.parametrize("spec,code,phrase", [
    ("{file}", 2, "expected FILE.py:FACTORY"),
    ("{file}:missing", 2, "has no function 'missing'"),
    ("{file}:wrong_shape", 2, "expected (2, 3) (one logit per class)"),
    ("{file}:not_a_module", 2, "returned a int, not a torch.nn.Module"),
    ("{broken}:build", 2, "importing it failed: ZeroDivisionError"),
    ("{absent}:build", 3, "does not exist"),
])
def test_model_def_errors_are_one_line(digits_folder, tmp_path, spec, code, phrase):
    (tmp_path / "mynet.py").write_text(MODEL_DEF)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    value = spec.format(file=tmp_path / "mynet.py", broken=tmp_path / "broken.py",
                        absent=tmp_path / "absent.py")
    run = run_cli("pipeline.py", "--dataset_path", digits_folder, "--model_def", value,
                  *ONE_EPOCH, "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, code, phrase)
    assert not (tmp_path / "m.onnx").exists()


def test_model_def_and_arch_together_are_refused(tmp_path):
    (tmp_path / "mynet.py").write_text(MODEL_DEF)
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--arch", "resnet18",
                  "--model_def", f"{tmp_path / 'mynet.py'}:build", "--output_model",
                  tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--model_def and --arch both name the network")


TABULAR_DEF = '''
from torch import nn


def build(num_classes, input_spec):
    return nn.Sequential(nn.Linear(input_spec["num_features"], 16), nn.ReLU(),
                         nn.Linear(16, num_classes))
'''


def test_model_def_for_tables_through_the_stage_clis(tmp_path):
    """train.py writes the bundle's copy of the file, export.py rebuilds from it; the wrapper
    imputes missing features inside the graph, so a NaN cell still gives a prediction."""
    source = tmp_path / "tabnet.py"
    source.write_text(TABULAR_DEF)
    model = tmp_path / "bundle" / "model.onnx"
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--model_def", f"{source}:build", *ONE_EPOCH,
                  "--output_model", model)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "bundle" / "model.def.py").read_text() == TABULAR_DEF
    source.unlink()
    run = run_cli("export.py", "--output_model", model, "--trust_model_code", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "bundle" / "model.json").read_text())
    assert manifest["files"]["model_def"] == "model.def.py"
    rows = np.full((2, len(manifest["preprocessing"]["feature_names"])), 13.0, np.float32)
    rows[1, :5] = np.nan
    probabilities = onnx_probabilities(model, rows)
    assert np.isfinite(probabilities).all() and probabilities.shape == (2, 3)


# ----------------------------------------------------------------------------- --model_def code
# Whatever the user's module does wherever it runs (import, factory, forward at any batch size,
# in training, validation or export) is its own: one line blaming it, exit 2, no bundle.

SMALL_NET = '''
import os
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        {forward}
        return self.head(x.mean(dim=(2, 3)))


def build(num_classes, input_spec):
    {factory}
    return Net(input_spec["channels"], num_classes)
'''


def small_net(folder: Path, forward: str = "pass", factory: str = "pass",
              name: str = "mynet.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(SMALL_NET.replace("{forward}", forward).replace("{factory}", factory))
    return path


def train_model_def(digits_folder: Path, spec: object, out: Path, *extra: str):
    return run_cli("train.py", "--dataset_path", digits_folder, "--model_def", spec,
                   *ONE_EPOCH, "--num_threads", "1", "--output_model", out / "model.onnx",
                   *extra)


def assert_no_bundle(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


@pytest.mark.parametrize("forward,factory,phrase", [
    # the shape check runs a batch of 2; the training batch (57 after the calibration slice)
    # is where it exits
    ("if len(x) > 2: sys.exit(3)", "pass", "its forward on a batch of (57, 1, 16, 16) "
     "torch.float32 called sys.exit(3)"),
    ("pass", "raise SystemExit", "the factory called sys.exit(None)"),
])
def test_model_def_that_exits_is_exit_2_blaming_it(digits_folder, tmp_path, forward, factory,
                                                   phrase):
    source = small_net(tmp_path / "src", forward, factory)
    run = train_model_def(digits_folder, f"{source}:build", tmp_path / "out")
    assert_clean_failure(run, 2, f"--model_def {source}:build", phrase, "must not exit")
    assert_no_bundle(tmp_path / "out")


def test_model_def_interrupted_is_still_130(digits_folder, tmp_path):
    source = small_net(tmp_path / "src", factory="raise KeyboardInterrupt")
    run = train_model_def(digits_folder, f"{source}:build", tmp_path / "out")
    assert run.returncode == 130, run.stderr[-2000:]
    assert "train.py: interrupted" in run.stderr and "error:" not in run.stderr
    assert_no_bundle(tmp_path / "out")


def test_model_def_prints_never_reach_stdout(digits_folder, tmp_path):
    """Python prints and writes to file descriptor 1, in the factory and in every forward."""
    source = small_net(tmp_path / "src", forward="print('forward', len(x)); "
                       "os.write(1, b'raw forward\\n')", factory="print('factory')")
    run = train_model_def(digits_folder, f"{source}:build", tmp_path / "out",
                          "--report_json", "-")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)  # stdout is the report alone
    assert report["status"] == "ok"
    assert "factory" in run.stderr and "forward 57" in run.stderr
    assert "raw forward" in run.stderr


BACKWARD_FAILS = '''
import torch
from torch import nn


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("no gradient here")


class Net(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        return Boom.apply(self.head(x.mean(dim=(2, 3))))


def build(num_classes, input_spec):
    return Net(input_spec["channels"], num_classes)
'''


@pytest.mark.parametrize("case,phrases", [
    ("big_batch", ["its forward on a batch of (57, 1, 16, 16)",
                   "ValueError: batch of 57 > 8", "fix forward in"]),
    ("one_sample", ["its forward on a batch of (1, 1, 16, 16)", "KeyError: 'single'"]),
    ("no_parameters", ["returned a module with no trainable parameters"]),
    ("backward", ["its code raised ArithmeticError: no gradient here (line 13)"]),
    ("folder", ["is a folder, not a Python file"]),
    ("text_file", ["notes.txt is not a Python file (.py)"]),
    ("csv_file", ["data.csv is not a Python file (.py)"]),
])
def test_model_def_errors_blame_the_module_not_the_tool(digits_folder, tmp_path, case, phrases):
    """The user's module fails only at the training batch size (57, not the check's 2), only on
    the one-sample batches validation predicts, in a custom backward, or has nothing to
    train; or --model_def names no Python file: exit 2 before any bundle, never exit 5."""
    src = tmp_path / "src"
    spec = {
        "big_batch": lambda: small_net(src, "if len(x) > 8: raise ValueError("
                                            "f'batch of {len(x)} > 8')"),
        "one_sample": lambda: small_net(src, "if len(x) == 1: raise KeyError('single')"),
        "no_parameters": lambda: small_net(src, factory="return nn.Flatten()"),
        "folder": lambda: src,
        "text_file": lambda: src / "notes.txt",
        "csv_file": lambda: src / "data.csv",
    }.get(case, lambda: src / "backward.py")()
    src.mkdir(exist_ok=True)
    (src / "notes.txt").write_text(SMALL_NET)
    (src / "data.csv").write_text("a,b\n1,2\n")
    (src / "backward.py").write_text(BACKWARD_FAILS)
    run = train_model_def(digits_folder, f"{spec}:build", tmp_path / "out")
    assert_clean_failure(run, 2, *phrases)
    assert "report it" not in run.stderr
    assert_no_bundle(tmp_path / "out")


def test_model_def_failing_only_in_the_export_blames_the_module(tmp_path):
    """train.py writes the bundle; export.py rebuilds the module from the bundle's copy, and its
    forward fails while traced for ONNX: exit 2 naming that copy, and no graph written."""
    source = tmp_path / "tabnet.py"
    source.write_text(TABULAR_DEF.replace(
        "def build(num_classes, input_spec):",
        "import torch\n\n\nclass Net(nn.Sequential):\n    def forward(self, x):\n"
        "        if torch.compiler.is_exporting():\n"
        "            raise NotImplementedError('no export, please')\n"
        "        return super().forward(x)\n\n\ndef build(num_classes, input_spec):").replace(
        "return nn.Sequential(", "return Net("))
    model = tmp_path / "bundle" / "model.onnx"
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--model_def", f"{source}:build", *ONE_EPOCH,
                  "--output_model", model)
    assert run.returncode == 0, run.stderr[-3000:]
    run = run_cli("export.py", "--output_model", model, "--trust_model_code", "true")
    assert_clean_failure(run, 2, "model.def.py:build: its forward (traced for the ONNX export)",
                         "NotImplementedError: no export, please", "re-create the bundle")
    assert not model.exists()


SIBLING_MODULE = '''
from torch import nn

import config
from utils import hidden_width


def build(num_classes, input_spec):
    return nn.Sequential(nn.Linear(input_spec["num_features"], hidden_width()), nn.ReLU(),
                         nn.Linear(hidden_width(), num_classes), nn.Dropout(config.DROPOUT))
'''


def test_model_def_imports_its_own_siblings_not_the_tools(tmp_path):
    """mynet.py imports its own utils.py and config.py, named like the tool's modules: it gets
    its own, and the tool's modules are the tool's again for the rest of the run (export,
    validation, the report)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "mynet.py").write_text(SIBLING_MODULE)
    (src / "utils.py").write_text("def hidden_width():\n    return 12\n")
    (src / "config.py").write_text("DROPOUT = 0.0\n")
    out = tmp_path / "bundle"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--model_def", f"{src / 'mynet.py'}:build", *ONE_EPOCH,
                  "--output_model", out / "model.onnx", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["export"]["top1_agreement"] == 1.0
    weights = torch.load(out / "model.pt", weights_only=True)
    assert weights["module.0.weight"].shape[0] == 12  # the user's hidden_width()
