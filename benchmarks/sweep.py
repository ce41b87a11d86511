"""The architecture sweep: transformers' classes and more, under tp 2, pp 2, tp 2 x pp 2, dp 2, the
planner's pick.

`python benchmarks/sweep.py` (or `make sweep`; hours on 2 cores) builds each class of transformers'
causal-LM, masked-LM, encoder-decoder, image-classification and speech (seq2seq and
audio-classification) auto mappings, and a few text classifiers, from its own config class shrunk
(hyparallel.models.tiny; ``SIZES`` adds overrides for the vision configs it does not shrink), plus
models built from torch.nn, diffusers' UNet2DModel, torchtitan's Llama3Model (the ``sweep`` extra:
``pip install -e ".[sweep]"``, torchtitan ``--no-deps``) and the hand-written models of
benchmarks/sweep_models.py (``--families`` picks; ``FAMILIES`` says what each is), and runs
``hyparallel.tools.parity.check_layouts`` for each: the layout in local gloo processes against one
process, 3 SGD steps, every gradient and loss compared (Note [a parity check],
hyparallel/tools/parity.py), trained with token cross-entropy (one class per row for a classifier)
or, where the output has no logits, the loss ``LOSSES`` names (Note [the loss a check trains]).
Results go to benchmarks/results/sweep.jsonl (one line per architecture; ``--resume`` keeps the
lines already there) and the table to docs/supported-models.md (``--render`` only rewrites the table
from the results).

An architecture that cannot be built from a config (or whose small copy does not run one forward and
backward on one process) is listed with why; its layouts are not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # column -> plan constraints (the degrees fixed; the rest the planner's pick)
    "tp 2": {"dp": 1, "tp": 2, "pp": 1},
    "pp 2": {"dp": 1, "tp": 1, "pp": 2},
    "tp 2 x pp 2": {"dp": 1, "tp": 2, "pp": 2},
    "dp 2": {"dp": 2, "tp": 1, "pp": 1},
    "planner's pick, 4 processes": {"world": 4},  # every plan the planner writes must run
    # Note [the ep column]: a model without MoE layers is refused there in one line, shown as "-"
    "ep 2": {"dp": 2, "tp": 1, "pp": 1, "ep": 2},
}
NO_EXPERTS = "has no mixture-of-experts layer the analysis could read, so"
SPLIT_LAYOUTS = ("tp 2", "pp 2", "tp 2 x pp 2")  # what the 80% count is of
HAND = {
    "nanoGPT (hand-written)": "benchmarks.sweep_models:nano_gpt",
    "CNN (hand-written)": "benchmarks.sweep_models:cnn",
    "embedding-heavy MLP (hand-written)": "benchmarks.sweep_models:embedding_mlp",
    "MoE decoder (hand-written)": "benchmarks.sweep_models:moe_lm",
    "MoE decoder with torch.where dispatch (hand-written)": "tests.tiny_lms:where_moe_lm",
}
TORCH_NN = {  # torch's own layers, as a user assembles them
    "nn.TransformerEncoder causal LM": "benchmarks.sweep_models:torch_encoder_lm",
    "nn.LSTM LM": "benchmarks.sweep_models:lstm_lm",
    "one block at every depth (shared weights)": "benchmarks.sweep_models:shared_block_lm",
}
DIFFUSION = {"diffusers UNet2DModel": "benchmarks.sweep_models:unet2d"}  # pip install -e ".[sweep]"
# pip install -e ".[sweep]"
TORCHTITAN = {"torchtitan Llama3Model": "benchmarks.sweep_models:titan_llama3"}
# a handful, not the whole mapping (~50 classes, most the encoders masked-lm already runs)
TEXT_CLASSIFICATION = [
    "BertForSequenceClassification",
    "RobertaForSequenceClassification",
    "DistilBertForSequenceClassification",
    "CLIPTextModel",  # CLIP's text tower, no head: trained with hidden_mse
]
# overrides on top of hyparallel.models.tiny's for vision configs it does not shrink (stage lists)
SIZES = {
    "ConvNextForImageClassification": (
        "image_size=32 num_stages=2 hidden_sizes=[16,32] depths=[2,2]"
    ),
    "SwinForImageClassification": (
        "image_size=32 embed_dim=32 depths=[2,2] num_heads=[2,4] window_size=4"
    ),
    "MobileNetV2ForImageClassification": "image_size=32",
    "ResNetForImageClassification": "embedding_size=16 hidden_sizes=[16,32] depths=[1,1]",
}
# Note [the loss a check trains]: architectures whose output the default token cross-entropy cannot
# read
LOSSES = {
    "CLIPTextModel": "benchmarks.sweep_models:hidden_mse",
    "diffusers UNet2DModel": "benchmarks.sweep_models:sample_mse",
}
FAMILIES = {  # --families name -> what the doc says it is
    "causal-lm": "transformers' causal-LM auto mapping",
    "masked-lm": "transformers' masked-LM auto mapping",
    "seq2seq": "transformers' encoder-decoder (seq2seq LM) auto mapping",
    "vision": (
        "transformers' image-classification auto mapping (ViT, ConvNeXt, Swin...): pixel_values in,"
        " class logits (batch, classes) out, trained with cross-entropy against one class per image"
    ),
    "speech": (
        "transformers' speech seq2seq (Whisper...) and audio-classification auto mappings:"
        " input_features or raw audio in"
    ),
    "text-classification": (
        "a handful of sequence classifiers (BERT, RoBERTa, DistilBERT: cross-entropy against"
        " one class per sequence) and CLIP's text tower (no head: MSE of its last hidden state)"
    ),
    "torch.nn": (
        "models built from torch's own layers: nn.TransformerEncoder, nn.LSTM, one block reused at"
        " every depth"
    ),
    "diffusion": (
        "diffusers' UNet2DModel (small: 32/64 channels, 4 attention heads), trained with the MSE of"
        " its sample against float targets"
    ),
    "torchtitan": (
        "torchtitan's Llama3Model (its own Linear/Embedding/RMSNorm classes, fused wqkv,"
        " grouped-query attention; SDPA as the inner attention), small"
    ),
    "hand-written": "the hand-written models of benchmarks/sweep_models.py",
}
RESULTS = ROOT / "benchmarks" / "results" / "sweep.jsonl"
MAX_PARAMETERS = 20_000_000  # a small copy above this is not small: listed as not built
DOC = ROOT / "docs" / "supported-models.md"


def architectures(families: list[str]) -> list[tuple[str, str, str]]:
    """(name, family, spec) for every class of the chosen auto mappings (each class once) and the
    hand-written."""
    from transformers.models.auto import modeling_auto

    mappings = {
        "causal-lm": [modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES],
        "masked-lm": [modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES],
        "seq2seq": [modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES],
        "vision": [modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES],
        "speech": [
            modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
            modeling_auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
        ],
        "text-classification": [{name: name for name in TEXT_CLASSIFICATION}],
    }
    own = {"hand": ("hand-written", HAND), "torch.nn": ("torch.nn", TORCH_NN)}
    own.update({"diffusion": ("diffusion", DIFFUSION), "torchtitan": ("torchtitan", TORCHTITAN)})
    out, seen = [], set()
    for family in families:
        if family in own:
            label, specs = own[family]
            out += [(name, label, spec) for name, spec in specs.items()]
            continue
        if family not in mappings:
            raise SystemExit(
                f"--families: no family {family!r}; the families: {', '.join([*mappings, *own])}"
            )
        classes = set()
        # a value may be a tuple of classes (DeiT: with and without a teacher)
        for mapping in mappings[family]:
            classes.update(
                name
                for value in mapping.values()
                for name in ([value] if isinstance(value, str) else value)
            )
        for cls in sorted(classes):
            if cls not in seen:
                seen.add(cls)
                out.append((cls, family, " ".join(filter(None, [f"hf:{cls}", SIZES.get(cls)]))))
    return out


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout("building and one step took over 120 s")


def builds(spec: str, loss: str | None = None) -> str | None:
    """None when the small copy builds and runs one forward and backward on one process (with
    ``loss``, a
    ``package.module:fn`` spec, else token cross-entropy), else why not."""
    import torch

    import hyparallel as hp
    from hyparallel.graph.tracer import call_with
    from hyparallel.runtime.parallel import token_cross_entropy
    from hyparallel.tensor.init import materialize_
    from hyparallel.tools.parity import _batches, small_spec

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    try:
        small = small_spec(spec)
        count = sum(p.numel() for p in hp.models.load(small).module.parameters())
        # sub-configs tiny.py does not shrink: gigabytes of reference gradients
        if count > MAX_PARAMETERS:
            return (
                f"its small copy still has {count:,} parameters (over {MAX_PARAMETERS:,}: a"
                " sub-config not shrunk)"
            )
        model = materialize_(hp.models.load(small).module, "cpu", seed=0)
        [(inputs, targets)] = _batches(
            hp.models.load(small).module, 2, 16, 1, 0, own_loss=loss is not None
        )
        loss_fn = hp.models.load_callable(loss, "loss function") if loss else token_cross_entropy
        loss_fn(call_with(model, inputs), targets).backward()
        return None
    except BaseException as exc:  # noqa: BLE001 -- the reason is the row
        text = " ".join(str(exc).split()) or type(exc).__name__
        return f"{type(exc).__name__}: {text[:240]}"
    finally:
        signal.alarm(0)
        torch.set_num_threads(max(1, torch.get_num_threads()))


def sweep(
    names: list[tuple[str, str, str]],
    out: Path,
    resume: bool,
    timeout: float,
    redo: set[str],
    columns: list[str] | None = None,
) -> None:
    """Run the layouts of each architecture of ``names`` not in ``out`` yet (``resume``) and append
    its row.

    ``columns``: only these layouts, for the architectures already in ``out``, whose cells they
    replace (a pass over the layouts a change touches); each replaced cell records it in
    ``rerun``."""
    import torch

    from hyparallel.tools.parity import check_layouts

    done = {}
    if (resume or columns) and out.exists():
        done = {row["arch"]: row for row in map(json.loads, out.read_text().splitlines())}
    if columns:
        _rerun_columns(names, done, out, columns, timeout)
        return
    for name in redo:
        done.pop(name, None)
    rows = list(done.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for index, (name, family, spec) in enumerate(names):
        if name in done:
            continue
        started = time.perf_counter()
        torch.set_grad_enabled(True)  # whatever the last architecture's failure left
        row = {
            "arch": name,
            "family": family,
            "spec": spec,
            **({"loss": LOSSES[name]} if name in LOSSES else {}),
        }
        why = builds(spec, LOSSES.get(name))
        if why is not None:
            row["cannot_build"] = why
        else:
            try:
                reports = check_layouts(
                    spec, list(LAYOUTS.values()), timeout=timeout, loss=LOSSES.get(name)
                )
                row["layouts"] = {
                    column: {
                        "verdict": r.verdict,
                        "reason": r.reason,
                        "plan": r.plan,
                        "mode": r.mode,
                    }
                    for column, r in zip(LAYOUTS, reports)
                }
            except Exception as exc:  # noqa: BLE001 -- a bug of the check itself: every layout failed, with why
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                row["layouts"] = {
                    column: {"verdict": "failed", "reason": f"the check: {why}"}
                    for column in LAYOUTS
                }
        row["seconds"] = round(time.perf_counter() - started, 1)
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        cells = row.get("layouts", {})
        shown = (
            ", ".join(f"{c}: {v['verdict']}" for c, v in cells.items())
            or f"cannot build ({why[:80]})"
        )
        print(f"[{index + 1}/{len(names)}] {name}: {shown} ({row['seconds']} s)", flush=True)


def _rerun_columns(
    names: list[tuple[str, str, str]],
    done: dict[str, dict],
    out: Path,
    columns: list[str],
    timeout: float,
) -> None:
    """The ``columns`` layouts again for every architecture of ``names`` that built; ``out``
    rewritten after each."""
    import torch

    from hyparallel.tools.parity import check_layouts

    for index, (name, _, spec) in enumerate(names):
        row = done.get(name)
        if row is None or "layouts" not in row:
            continue
        started = time.perf_counter()
        torch.set_grad_enabled(True)
        try:
            reports = check_layouts(
                spec, [LAYOUTS[c] for c in columns], timeout=timeout, loss=LOSSES.get(name)
            )
            cells = {
                c: {
                    "verdict": r.verdict,
                    "reason": r.reason,
                    "plan": r.plan,
                    "mode": r.mode,
                    "rerun": True,
                }
                for c, r in zip(columns, reports)
            }
        except Exception as exc:  # noqa: BLE001 -- a bug of the check itself
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            cells = {
                c: {"verdict": "failed", "reason": f"the check: {why}", "rerun": True}
                for c in columns
            }
        row["layouts"].update(cells)
        out.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
        shown = ", ".join(f"{c}: {v['verdict']}" for c, v in cells.items())
        print(
            f"[{index + 1}/{len(names)}] {name}: {shown} ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )


# Note [the ep column]
#     Expert parallelism (issue 38) applies to models with MoE layers only: every other row's ep 2
#     is refused by check_plan ("... has no mixture-of-experts layer ..."), shown as "-", as is a
#     row from before the column (not run).


def _applies(result: dict | None) -> bool:
    """Whether a cell's layout applies to its model (Note [the ep column])."""
    return result is not None and NO_EXPERTS not in (result.get("reason") or "")


def _cell(result: dict | None, notes: dict[str, int]) -> str:
    if not _applies(result):
        return "-"
    verdict = result["verdict"]
    picked = (result.get("plan") or {}).get("picked")
    if verdict == "equal":
        said = [picked] if picked else []
        if result.get("mode") == "eval":  # Note [a parity check]: a model that samples in training
            said.append("compared in eval mode: it samples in training")
        return f"equal ({'; '.join(said)})" if said else "equal"
    reason = (result.get("reason") or "").replace("|", "/")
    number = notes.setdefault(reason, len(notes) + 1)
    return f"{verdict} [{number}]"


def _family_lines(built: list[dict]) -> list[str]:
    """Per family: how many architectures are equal under every layout, and the planner's picks that
    ran."""
    lines = []
    for family in dict.fromkeys(r["family"] for r in built):
        mine = [r for r in built if r["family"] == family]
        every = sum(
            all(v["verdict"] == "equal" for v in r["layouts"].values() if _applies(v)) for r in mine
        )
        picks = [r["layouts"].get("planner's pick, 4 processes") for r in mine]
        ran = sum(1 for p in picks if p and p["verdict"] == "equal")
        lines.append(
            f"- {family}: {len(mine)} built; {every} equal under every layout; the planner's own"
            f" pick for 4 processes ran equal for {ran} of {len(mine)}"
        )
    return lines


def render(rows: list[dict], doc: Path, remark: str = "", expected: list[str] = ()) -> None:
    """Write docs/supported-models.md from the sweep's rows."""
    import torch
    import transformers

    # passes append: the table sorts
    order = {family: index for index, family in enumerate(FAMILIES)}
    rows = sorted(rows, key=lambda r: (order.get(r["family"], 9), r["arch"].lower()))
    built = [r for r in rows if "layouts" in r]
    causal = [r for r in built if r["family"] == "causal-lm"]
    passing = [
        r for r in causal if all(r["layouts"][c]["verdict"] == "equal" for c in SPLIT_LAYOUTS)
    ]
    differs = [
        (r["arch"], c) for r in built for c, v in r["layouts"].items() if v["verdict"] == "differs"
    ]
    experts = [r for r in built if _applies(r["layouts"].get("ep 2"))]
    experts_equal = sum(r["layouts"]["ep 2"]["verdict"] == "equal" for r in experts)
    failed = [
        (r["arch"], c) for r in built for c, v in r["layouts"].items() if v["verdict"] == "failed"
    ]
    share = 100 * len(passing) / max(1, len(causal))
    lines = [
        "# Supported models",
        "",
        "<!-- generated by benchmarks/sweep.py (`make sweep`); do not edit by hand -->",
        "",
        (
            "Every architecture below was built small from its own config class (transformers"
            f" {transformers.__version__}, torch {torch.__version__}): 2 layers, width 64, 4 query"
            " heads (multi-query and grouped-query kept), 128 tokens, 4 experts where it has"
            " experts (hyparallel/models/tiny.py; the vision configs whose stage lists it does not"
            " shrink with the sizes of SIZES in benchmarks/sweep.py); the models that are not"
            " transformers classes at the sizes their factories in benchmarks/sweep_models.py"
            " give. Each layout ran in local gloo processes against one process on the same"
            " weights and batches, 3 SGD steps, fp32: every parameter's gradient and every loss"
            " within rtol 1e-5 / atol 1e-6 is **equal**. **refused** is hyparallel saying no"
            " before the first collective (the line it printed is in the notes); **failed** is a"
            " crash, a bug; **differs** would be a wrong result, and is a failing test wherever it"
            " shows."
        ),
        "",
        "Run the same check on your own model: `hyparallel check MODEL --tp 2 --pp 2` (README).",
        "",
        (
            f"**Causal LMs: {len(passing)} of {len(causal)} that build from a config ({share:.0f}%)"
            " give the single-device numbers under tp 2, pp 2 and tp 2 x pp 2.** Layouts that"
            f" differ: {len(differs)}; that crashed: {len(failed)}. Architectures that could not be"
            f" built: {len(rows) - len(built)}."
        ),
        "",
        *_family_lines(built),
        "",
        (
            f"**Expert parallelism (ep 2, dp 2): {experts_equal} of the {len(experts)} models it"
            " applies to give the single-device numbers**; the others are refused in one line (the"
            " notes). A model with no MoE layer the analysis reads (Note [an MoE layer read from"
            " the trace]) shows - there."
        ),
        "",
        (
            "The families (`benchmarks/sweep.py --families`; the classes of a transformers family"
            " are those of its auto mapping, the architectures not run are listed at the end):"
        ),
        "",
        *[
            f"- {family}: {FAMILIES[family]}"
            for family in dict.fromkeys(r["family"] for r in rows)
            if family in FAMILIES
        ],
        *(["", remark] if remark else []),
        "",
        "| architecture | family | " + " | ".join(LAYOUTS) + " |",
        "|---|---|" + "---|" * len(LAYOUTS),
    ]
    notes: dict[str, int] = {}
    for row in built:
        cells = [_cell(row["layouts"].get(c), notes) for c in LAYOUTS]
        arch = row["arch"] + (
            f" (loss: {row['loss'].rpartition(':')[2]})" if row.get("loss") else ""
        )
        lines.append(f"| {arch} | {row['family']} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"{number}. {reason}" for reason, number in notes.items()]
    unbuilt = [r for r in rows if "cannot_build" in r]
    if unbuilt:
        lines += [
            "",
            "## Not built from a config",
            "",
            "| architecture | family | why |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['family']} | {r['cannot_build'].replace('|', '/')} |"
            for r in unbuilt
        ]
    missing = [name for name in expected if name not in {r["arch"] for r in rows}]
    if missing:
        lines += ["", "## Not run in this sweep", "", ", ".join(missing)]
    doc.write_text("\n".join(lines) + "\n")
    print(f"{doc}: {len(passing)}/{len(causal)} causal LMs equal under every split ({share:.0f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        default="causal-lm,masked-lm,seq2seq,vision,speech,text-classification,torch.nn,diffusion,torchtitan,hand",
    )
    parser.add_argument("--only", default="", help="comma-separated architecture names")
    parser.add_argument("--resume", action="store_true", help="keep the results already in --out")
    parser.add_argument("--render", action="store_true", help="only rewrite the table from --out")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per layout launch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument(
        "--remark", default="", help="a paragraph for the table's header (how this run was made)"
    )
    parser.add_argument(
        "--columns",
        default="",
        help=(
            "';'-separated layout columns (or their first words: 'dp 2;planner') to run again for"
            " the rows in --out"
        ),
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if not args.render:
        names = architectures(args.families.split(","))
        wanted = set(filter(None, args.only.split(",")))
        if wanted:
            names = [n for n in names if n[0] in wanted]
        columns = []
        for given in filter(None, (c.strip() for c in args.columns.split(";"))):
            found = [c for c in LAYOUTS if c == given] or [
                c for c in LAYOUTS if c.startswith(given)
            ]
            if len(found) != 1:
                parser.error(
                    f"--columns: {given!r} names no one layout; the layouts are:"
                    f" {'; '.join(LAYOUTS)}"
                )
            columns.append(found[0])
        sweep(names, args.out, args.resume or bool(wanted), args.timeout, wanted, columns or None)
    expected = [name for name, _, _ in architectures(args.families.split(","))]
    render(
        [json.loads(line) for line in args.out.read_text().splitlines()],
        args.doc,
        args.remark,
        expected,
    )


if __name__ == "__main__":
    main()
