"""A tiny BERT trained from scratch with `--arch hf:DIR` on the SMS Spam Collection, measured
side by side in one run against the four goals of issue 19:

    python bench/hf_text.py --sms DATA/sms_spam.tsv [--epochs 4] [--learning_rate 1e-3]
                            [--threads 1] [--repeats 2] [--rows 100000] [--input_batch_size 32]
                            [--quick] [--reuse] [--profile auto|always|never] [--out DIR]

(a) test accuracy ≥ 0.95; (b) ONNX Runtime fp32 ≥ 2x PyTorch eager at batch 1 (p50 latency);
(c) dynamic int8 ≥ 1.3x ORT fp32 at batch 32 (throughput over the same test batches) with at
most 1 point of accuracy lost; (d) `inference.py --input` on --rows texts ≥ 80% of raw
`session.run` throughput at the same batch size (tokenization excluded from the raw figure).

The TSV is split here (seeded, stratified, 20% test) so that the WordPiece vocabulary is
trained on the training texts only; the model is a randomly initialised BERT written with
save_pretrained (no pretrained weights), and `pipeline.py --arch hf:DIR --test_path TEST
--quantize dynamic --benchmark true` trains, exports and quantizes it as a user would type it;
its report JSON gives the accuracies. The timings are taken here with runtime.time_runners
(runners in turns on the same batches of real test texts, tokenized by the bundle's tokenizer),
--threads threads for PyTorch and ONNX Runtime alike, --repeats times. When (d) misses, where
`inference.py --input` spends its time is profiled (cProfile, the reader thread run inline).
--quick: a much smaller BERT (hidden 32, vocabulary 300, no dropout: so no MC-dropout graph
for pipeline.py to export, which nothing here times), 1 epoch, 200 rows, 1 round, the profile
always, in a temporary folder, on a generated stand-in for the SMS texts without --sms.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import REPO, Config, add_quick_flag, quiet_single_thread, sms_or_standin

# The tiny BERT: BERT-Tiny's shape (Turc et al. 2019, L=2, H=128, A=2, intermediate 512) with a
# WordPiece vocabulary trained on the SMS training texts, and 128 positions (SMS texts are short).
BERT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=128)
VOCAB_SIZE = 6000
# --quick: the tests' tiny BERT (tests/conftest.py tiny_hf_model), seconds to train; without
# dropout, as a bundle then has no MC-dropout graph (its export: 2 to 3 s of the smoke run)
QUICK_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
QUICK_VOCAB_SIZE = 300
DEFAULT_OUT = "runs/bench_hf_text"
TEST_FRACTION = 0.2
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GOALS = {"a": 0.95, "b": 2.0, "c": 1.3, "c_drop": 0.01, "d": 0.8}


# ----------------------------------------------------------------------------- data and model


def split_tsv(sms: Path, out: Path, seed: int) -> tuple[Path, Path, list[str], list[str]]:
    """train.tsv and test.tsv (the original lines, stratified by label); the texts of each."""
    lines = [line for line in sms.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = np.array([line.split("\t", 1)[0] for line in lines])
    rng = np.random.default_rng(seed)
    test = np.zeros(len(lines), dtype=bool)
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        test[rows[: round(len(rows) * TEST_FRACTION)]] = True
    paths = out / "train.tsv", out / "test.tsv"
    for path, keep in zip(paths, (~test, test)):
        path.write_text("".join(line + "\n" for line, k in zip(lines, keep) if k),
                        encoding="utf-8")
    texts = [line.split("\t", 1)[-1] for line in lines]
    return (*paths, [t for t, k in zip(texts, test) if not k],
            [t for t, k in zip(texts, test) if k])


def tiny_bert(folder: Path, texts: list[str], seed: int, shape: dict = BERT,
              vocab_size: int = VOCAB_SIZE) -> dict:
    """A WordPiece tokenizer trained on `texts` and a randomly initialised BERT, written by
    save_pretrained as a hub checkpoint would be: what `--arch hf:<folder>` loads."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                                 special_tokens=SPECIALS))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=shape["max_position_embeddings"])
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=backend.get_vocab_size(), pad_token_id=tokenizer.pad_token_id,
                        **shape)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    model.save_pretrained(folder)
    return {**shape, "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())}


def train(args, folder: Path, train_path: Path, test_path: Path, out: Path) -> tuple[dict, float]:
    """pipeline.py as a user would type it; (its report, wall seconds)."""
    report = out / "report.json"
    command = [sys.executable, str(REPO / "pipeline.py"), "--model_type", "text_classifier",
               "--dataset_path", str(train_path), "--test_path", str(test_path),
               "--label_column", "0", "--text_column", "1", "--arch", f"hf:{folder}",
               "--learning_rate", str(args.learning_rate), "--epochs", str(args.epochs),
               "--batch_size", "32", "--quantize", "dynamic", "--benchmark", "true",
               "--num_threads", str(args.threads), "--seed", str(args.seed),
               "--output_model", str(out / "model.onnx"), "--report_json", str(report),
               "--no_progress", "true"]
    print("$ " + " ".join(command[1:]), file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"pipeline.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(report.read_text()), seconds


# ----------------------------------------------------------------------------- timing


def tokenized_batches(tokenizer, texts: list[str], size: int) -> list[np.ndarray]:
    """Each batch tokenized alone: padded to its own longest text, as inference pads."""
    return [tokenizer.encode_batch(texts[i:i + size]) for i in range(0, len(texts), size)]


def side_by_side(model: Path, texts: list[str], threads: int) -> dict:
    """(b) eager vs ORT fp32 at batch 1 and (c) ORT fp32 vs int8 at batch 32, in turns."""
    import torch

    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.nets.models import WithProbabilities, load_weights
    from ttc.inputs.preprocess import text_tokenizer
    from ttc.serving.runtime import create_session, session_runner, time_runners

    paths = BundlePaths.from_model_path(model)
    manifest = read_manifest(paths)  # registers the bundle's tokenizer.json
    tokenizer = text_tokenizer(manifest.preprocessing.spec)
    runtime = Config(num_threads=threads).cpu_runtime()
    fp32 = session_runner(create_session(str(paths.onnx), runtime))
    int8 = session_runner(create_session(str(paths.int8), runtime))
    wrapper = WithProbabilities(load_weights(manifest, paths.weights)).eval()

    def eager(batch: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return wrapper(torch.from_numpy(batch))[1].numpy()

    ones = tokenized_batches(tokenizer, texts, 1)
    single = time_runners([eager, fp32], ones, runs=len(ones))
    thirty_two = tokenized_batches(tokenizer, texts, 32)
    batched = time_runners([fp32, int8], thirty_two, runs=2 * len(thirty_two))
    return {"eager_ms_1": single.percentile_ms(0, 50), "ort_ms_1": single.percentile_ms(1, 50),
            "ort_over_eager_1": single.percentile_ms(0, 50) / single.percentile_ms(1, 50),
            "fp32_per_s_32": batched.throughput(0), "int8_per_s_32": batched.throughput(1),
            "int8_over_fp32_32": batched.throughput(1) / batched.throughput(0),
            "fp32_ms_32": batched.percentile_ms(0, 50), "int8_ms_32": batched.percentile_ms(1, 50)}


def write_input(path: Path, rows: int, texts: list[str]) -> None:
    """`rows` texts (the test texts over and over) as a one-column CSV, as bench/batch_scale.py
    writes them."""
    clean = [t.replace('"', "'").replace("\n", " ") for t in texts]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("text\n")
        for start in range(0, rows, len(clean)):
            handle.write("".join(f'"{t}"\n' for t in clean[: rows - start]))


def end_to_end(model: Path, data: Path, batch_size: int, threads: int) -> dict:
    """`inference.py --input` as a subprocess: wall rows/s, and its own (report) rows/s."""
    report = data.with_name("input_report.json")
    command = [sys.executable, str(REPO / "inference.py"), "--model", str(model), "--input",
               str(data), "--output", str(data.with_name("preds.csv")), "--batch_size",
               str(batch_size), "--text_column", "text", "--num_threads", str(threads),
               "--quiet", "true",
               "--report_json", str(report)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"inference.py --input failed:\n{done.stderr[-3000:]}")
    predictions = json.loads(report.read_text())["predictions"]
    return {"wall_s": wall, "wall_per_s": predictions["predicted"] / wall,
            "own_per_s": predictions["rows_per_s"], "own_s": predictions["seconds"]}


def encoded_input(model: Path, data: Path) -> list[np.ndarray]:
    """The input's token ids, chunk by chunk, read and encoded beforehand by batch.py's own
    reader (the chunks inference.py --input predicts, 4,096 rows each)."""
    from ttc.serving.batch import BatchOptions, input_chunks
    from ttc.serving.bundle import BundlePaths, read_manifest

    manifest = read_manifest(BundlePaths.from_model_path(model))
    return [chunk.x for chunk in input_chunks(manifest, BatchOptions(str(data), "unused.csv",
                                                                      text_column="text"))]


def raw_throughput(model: Path, chunks: list[np.ndarray], batch_size: int, threads: int,
                   by_length: bool = False) -> float:
    """session.run rows/s over feeds built beforehand: the same graph, and the same batches of
    the same ids as inference.py --input runs (runtime.batches_of within each chunk); with
    `by_length`, each chunk's rows sorted by token count first (what inference.py does not do:
    an estimate of what length-bucketing would gain)."""
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.inputs.preprocess import trim_padding
    from ttc.serving.runtime import batches_of, create_session, session_feeder

    pad_id = read_manifest(BundlePaths.from_model_path(model)).input.pad_id
    session = create_session(str(model), Config(num_threads=threads).cpu_runtime())
    feed = session_feeder(session)
    if by_length:
        chunks = [x[np.argsort((x != pad_id).sum(1), kind="stable")] for x in chunks]
    feeds = [feed(np.ascontiguousarray(trim_padding(batch, pad_id)))
             for x in chunks for batch in batches_of(x, batch_size)]
    session.run(["probabilities"], feeds[0])
    started = time.perf_counter()
    for item in feeds:
        session.run(["probabilities"], item)
    return sum(len(x) for x in chunks) / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- profile

STAGES = [("read the CSV (tables.iter_table, pandas)", ("tables.py", "iter_table")),
          ("tokenize (HFTokenizer.encode_batch)", ("preprocess.py", "encode_batch")),
          ("batch + trim padding (runtime.batches_of)", ("runtime.py", "batches_of")),
          ("feed: attention mask (text_graph_feed)", ("preprocess.py", "text_graph_feed")),
          ("ONNX Runtime session.run", ("onnxruntime_inference_collection.py", "run")),
          ("write predictions (PredictionWriter.write)", ("batch.py", "write"))]


def profile_input(model: Path, data: Path, batch_size: int, threads: int) -> None:
    """inference.py --input in this process under cProfile, the reader thread's work inline
    (cProfile sees one thread): the cumulative seconds of each stage."""
    from ttc.serving import batch
    from config import Config as RunConfig
    from ttc.online.predict import predict_new_data
    from ttc.serving.bundle import BundlePaths

    config = RunConfig(output_model=str(model), input=str(data), batch_size=batch_size,
                       output=str(data.with_name("profile_preds.csv")), num_threads=threads,
                       text_column="text",
                       no_progress=True)
    inline = batch.prefetched
    batch.prefetched = lambda chunks, depth=2: iter(chunks)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    try:
        profiler.runcall(predict_new_data, config, BundlePaths.from_model_path(model), "onnx", {})
    finally:
        batch.prefetched = inline
    total = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    print(f"\nprofile of inference.py --input on {data.name}, the reader inline (cProfile sees "
          f"one thread), {total:.1f} s under cProfile:")
    for name, (file, function) in STAGES:
        seconds = sum(row[3] for key, row in stats.stats.items()
                      if key[0].endswith(file) and key[2] == function)
        print(f"  {name:<45} {seconds:7.2f} s  {seconds / total:6.1%}")
    print("  top functions by own time:")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:10]
    for (file, line, function), row in rows:
        print(f"    {row[2]:7.2f} s  {Path(file).name}:{line} {function}")


# ----------------------------------------------------------------------------- main


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); "
                        "without it the run is skipped")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch and ONNX Runtime "
                        "threads, for training and every timing")
    parser.add_argument("--repeats", type=int, default=2, help="timing rounds (all timings)")
    parser.add_argument("--rows", type=int, default=100_000, help="texts for inference.py --input")
    parser.add_argument("--input_batch_size", type=int, default=32,
                        help="--batch_size of the inference.py --input run and its raw figure")
    parser.add_argument("--seed", type=int, default=0)
    add_quick_flag(parser)
    parser.add_argument("--profile", choices=("auto", "always", "never"),
                        help="profile inference.py --input when (d) misses (auto, the default; "
                        "always with --quick)")
    parser.add_argument("--reuse", action="store_true", help="keep the model that an earlier "
                        "run left in --out (same flags): time it again without retraining")
    parser.add_argument("--out", help=f"where the model, data and results go (default: "
                        f"{DEFAULT_OUT}; with --quick a temporary folder)")
    args = parser.parse_args()
    if not args.sms and not args.quick:
        parser.exit(0, "skipped: pass --sms PATH (the SMS Spam Collection TSV)\n")
    args.profile = args.profile or ("always" if args.quick else "auto")
    if args.quick:
        args.epochs, args.rows, args.repeats = 1, 200, 1
    args.sms = sms_or_standin(args.sms, args.quick)
    if args.out or not args.quick:
        measure(args, Path(args.out or DEFAULT_OUT).resolve())
        return
    with tempfile.TemporaryDirectory(prefix="bench_hf_text_") as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, out: Path) -> None:
    """Train (or --reuse) the tiny BERT in `out`, time it, print the goals."""
    out.mkdir(parents=True, exist_ok=True)
    quiet_single_thread(args.quick)
    import torch

    torch.set_num_threads(args.threads)

    train_path, test_path, train_texts, test_texts = split_tsv(Path(args.sms), out, args.seed)
    shape = (json.loads((out / "hf_text.json").read_text())["model"]
             if args.reuse and (out / "hf_text.json").is_file()
             else tiny_bert(out / "tiny_bert", train_texts, args.seed,
                            *((QUICK_BERT, QUICK_VOCAB_SIZE) if args.quick else ())))
    print(f"tiny BERT: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"{shape['num_attention_heads']} heads, intermediate {shape['intermediate_size']}, "
          f"{shape['max_position_embeddings']} positions, WordPiece vocabulary "
          f"{shape['vocab_size']} (trained on the {len(train_texts)} training texts), "
          f"{shape['parameters']:,} parameters, random initialisation", flush=True)
    if args.reuse and (out / "hf_text.json").is_file():
        report = json.loads((out / "report.json").read_text())
        train_seconds = json.loads((out / "hf_text.json").read_text())["pipeline_seconds"]
    else:
        report, train_seconds = train(args, out / "tiny_bert", train_path, test_path, out)
    model = out / "model.onnx"
    quant = report["quantize"]
    accuracy, accuracy_int8 = quant["accuracy_fp32"], quant["accuracy"]
    test_labels = [line.split("\t", 1)[0] for line in
                   test_path.read_text(encoding="utf-8").splitlines()]
    majority = max(test_labels.count(label) for label in set(test_labels)) / len(test_labels)
    train_section = report["train"]
    print(f"pipeline.py: {train_section['epochs_run']} epochs, lr {args.learning_rate:g}, "
          f"{train_seconds:.0f} s wall ({train_section['seconds']:.0f} s training); test "
          f"accuracy fp32 {accuracy:.4f}, int8 {accuracy_int8:.4f} on {len(test_texts)} test "
          f"texts (majority-class baseline {majority:.4f}); quantizer: {quant['verdict']}",
          flush=True)
    for row in report.get("benchmark", []):
        print(f"  pipeline benchmark: {row['variant']:<28} p50@1 "
              f"{row['latency_ms_p50_batch1']:.3f} ms, {row['throughput_per_s']:.0f}/s at "
              f"batch {row['batch_size']}, accuracy {row['accuracy']:.4f}")

    data = out / f"input_{args.rows}.csv"
    write_input(data, args.rows, test_texts)
    chunks = encoded_input(model, data)
    rounds = []
    for k in range(args.repeats):
        timed = side_by_side(model, test_texts, args.threads)
        timed.update({f"e2e_{key}": v for key, v in
                      end_to_end(model, data, args.input_batch_size, args.threads).items()})
        timed["raw_per_s"] = raw_throughput(model, chunks, args.input_batch_size,
                                            args.threads)
        timed["sorted_per_s"] = raw_throughput(model, chunks, args.input_batch_size,
                                               args.threads, by_length=True)
        timed["e2e_over_raw"] = timed["e2e_own_per_s"] / timed["raw_per_s"]
        timed["wall_over_raw"] = timed["e2e_wall_per_s"] / timed["raw_per_s"]
        rounds.append(timed)
        print(json.dumps({"round": k + 1, **{key: round(v, 4) for key, v in timed.items()}}),
              file=sys.stderr, flush=True)

    drop = accuracy - accuracy_int8
    worst = {"b": min(r["ort_over_eager_1"] for r in rounds),
             "c": min(r["int8_over_fp32_32"] for r in rounds),
             "d": min(r["e2e_over_raw"] for r in rounds)}
    names = [f"round {k + 1}" for k in range(len(rounds))]
    from ttc.serving.runtime import cpu_info

    cpu = cpu_info().describe()
    print(f"\nCPU: {cpu} (int8 speed depends on it: bench/int8_gemm.py)")
    print(f"{args.threads} thread(s) for PyTorch and ONNX Runtime; {len(test_texts)} test "
          f"texts; (d) on {args.rows:,} texts at batch {args.input_batch_size}, fp32 graph")
    print(f"{'figure':<52}" + "".join(f"{n:>12}" for n in names))
    lines = [("PyTorch eager fp32, p50 ms at batch 1", "eager_ms_1", ".3f"),
             ("ORT fp32, p50 ms at batch 1", "ort_ms_1", ".3f"),
             ("(b) ORT fp32 / eager at batch 1", "ort_over_eager_1", ".3f"),
             ("ORT fp32, texts/s at batch 32", "fp32_per_s_32", ",.0f"),
             ("ORT int8 (dynamic), texts/s at batch 32", "int8_per_s_32", ",.0f"),
             ("(c) int8 / fp32 throughput at batch 32", "int8_over_fp32_32", ".3f"),
             ("    p50 ms per batch of 32, fp32", "fp32_ms_32", ".2f"),
             ("    p50 ms per batch of 32, int8", "int8_ms_32", ".2f"),
             ("raw session.run, texts/s", "raw_per_s", ",.0f"),
             ("inference.py --input, its own texts/s", "e2e_own_per_s", ",.0f"),
             ("    raw, rows sorted by length in each chunk", "sorted_per_s", ",.0f"),
             ("inference.py --input, wall texts/s (with start-up)", "e2e_wall_per_s", ",.0f"),
             ("(d) inference.py own / raw", "e2e_over_raw", ".1%"),
             ("    inference.py wall / raw", "wall_over_raw", ".1%")]
    for label, key, fmt in lines:
        print(f"{label:<52}" + "".join(f"{format(r[key], fmt):>12}" for r in rounds))
    print(f"\ngoal (a) test accuracy ≥ {GOALS['a']}: fp32 {accuracy:.4f} -> "
          f"{verdict(accuracy >= GOALS['a'])}")
    print(f"goal (b) ORT fp32 ≥ {GOALS['b']}x eager at batch 1: worst round {worst['b']:.3f}x "
          f"-> {verdict(worst['b'] >= GOALS['b'])}")
    print(f"goal (c) int8 ≥ {GOALS['c']}x fp32 at batch 32, ≤ 1 point lost: worst round "
          f"{worst['c']:.3f}x, accuracy {accuracy:.4f} -> {accuracy_int8:.4f} "
          f"({-100 * drop:+.2f} pt) -> "
          f"{verdict(worst['c'] >= GOALS['c'] and drop <= GOALS['c_drop'])}")
    print(f"goal (d) inference.py --input ≥ {GOALS['d']:.0%} of raw session.run: worst round "
          f"{worst['d']:.1%} -> {verdict(worst['d'] >= GOALS['d'])}")
    (out / "hf_text.json").write_text(json.dumps(
        {"model": shape, "cpu": cpu, "pipeline_seconds": train_seconds, "epochs": args.epochs,
         "learning_rate": args.learning_rate,
         "threads": args.threads, "accuracy_fp32": accuracy, "accuracy_int8": accuracy_int8,
         "quantizer_verdict": quant["verdict"], "rounds": rounds,
         "pipeline_benchmark": report.get("benchmark")}, indent=1))
    if args.profile == "always" or (args.profile == "auto" and worst["d"] < GOALS["d"]):
        sample = out / "input_profile.csv"  # the breakdown's shares need no 100,000 rows
        write_input(sample, min(args.rows, 20_000), test_texts)
        profile_input(model, sample, args.input_batch_size, args.threads)


if __name__ == "__main__":
    main()
