"""Property-based fuzzing of the CLI with bad input (issue 14): every defect is refused with one
line.

Each example starts from a valid input (a plan the planner wrote, a cluster preset, a command line
that works) and injects exactly one defect chosen by hypothesis: a wrong type, a number out of range
(zero, negative, past the bound, huge, inf/nan), deep nesting, an unknown key, a duplicate key in
the YAML text, bytes that are not UTF-8, an alias bomb, a non-mapping file; on the command line an
unknown command or flag, a missing argument, a bad numeric flag, a bad model spec, a bad output
path. The CLI runs in process and must exit 2 with at most three lines on stderr, no traceback,
nothing on stdout, nothing written to its output path, and return within a watchdog's 20 seconds (a
hang detector, not a timing). The examples are derandomized: the same few hundred run every time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import re
import signal
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.spec import limits
from hyparallel.spec.yaml_io import dump_yaml

FUZZ = settings(
    derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
WATCHDOG_S = 20
SENTINEL = "an existing file the failed command must leave alone\n"


class Hang(Exception):
    """The CLI ran past the watchdog."""


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``hyparallel.cli.main(argv)`` in this process: (exit status, stdout, stderr), under a SIGALRM
    watchdog."""

    def hang(signum, frame):
        raise Hang(f"hyparallel {' '.join(argv)[:200]} ran past {WATCHDOG_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(WATCHDOG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's --help and friends; bad input must not get here
                code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], output: Path | None = None, existed: bool = False) -> None:
    """Exit 2, one short error on stderr, no traceback, nothing on stdout, nothing written to
    ``output``."""
    code, out, err = run_cli(argv)
    assert code == 2, (argv, code, out[-2000:], err[-2000:])
    assert out == "", (argv, out[-2000:])
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, (argv, err[-3000:])
    assert lines[0].startswith("hyparallel"), (argv, err)
    if output is not None:
        if existed:
            assert output.read_text() == SENTINEL, argv
        else:
            assert not output.exists(), argv
        leftovers = sorted(p.name for p in output.parent.iterdir() if p.name.startswith("."))
        assert not leftovers, (argv, leftovers)  # no temporary file left behind


# ---- values, by what a field holds ---------------------------------------------------------------

# Strict int fields refuse floats, bools and strings; float fields are lax (a numeric string or a
# bool would pass), so they get only values no reading turns into a finite number.
KEYS = st.text(string.ascii_letters, min_size=1, max_size=4)
SMALL_JSON = st.recursive(
    st.integers(-5, 5) | st.text(string.ascii_letters, max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=6,
)
CONTAINERS = st.lists(SMALL_JSON, max_size=3) | st.dictionaries(KEYS, SMALL_JSON, max_size=3)
WORDS = st.text(string.ascii_letters + "-_", min_size=1, max_size=12)
WRONG_TYPE = {
    "int": (
        st.floats(allow_nan=False, allow_infinity=False)
        | st.booleans()
        | st.text(max_size=12)
        | CONTAINERS
    ),
    "float": (
        WORDS.filter(lambda w: w.lower().lstrip("-+") not in ("inf", "infinity", "nan"))
        | CONTAINERS
    ),
    "bool": (
        st.sampled_from(["maybe", "sometimes", "2"])
        | st.integers().filter(lambda i: i not in (0, 1))
        | CONTAINERS
    ),
    "str": st.integers() | st.floats(allow_nan=False) | st.booleans() | CONTAINERS,
}


def out_of_range(kind: str, low: float, high: float | None) -> st.SearchStrategy:
    """Numbers outside [low, high]: below, above (up to 1,000 digits), and for floats inf and
    nan."""
    if kind == "int":
        huge = st.integers(30, 999).map(lambda k: 10**k)
        above = st.integers(min_value=int(high) + 1, max_value=int(high) + 10**6) | huge
        return st.integers(max_value=int(low) - 1) | above
    below = st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False)
    above = (
        below
        if high is None
        else st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False)
    )
    return below | above | st.sampled_from([float("nan"), float("inf"), float("-inf")])


def wrong_choice(choices: tuple) -> st.SearchStrategy:
    if isinstance(choices[0], int):
        return st.integers().filter(lambda i: i not in choices) | CONTAINERS
    return st.text(max_size=12).filter(lambda t: t not in choices) | st.integers() | CONTAINERS


# ---- the fields of a plan and of a cluster file --------------------------------------------------

CLUSTER_FIELDS = [  # (path, kind, low, high): the bounds are hyparallel.spec.limits'
    (("num_nodes",), "int", 1, limits.MAX_DEVICES),
    (("gpus_per_node",), "int", 1, limits.MAX_GPUS_PER_NODE),
    (("name",), "str", None, None),
    (("backend",), ("nccl", "gloo"), None, None),
    (("device", "name"), "str", None, None),
    (("device", "memory_bytes"), "int", 1, limits.MAX_DEVICE_MEMORY_BYTES),
    (("device", "reserved_bytes"), "int", 0, limits.MAX_DEVICE_MEMORY_BYTES),
    (("device", "peak_flops", "bf16"), "float", limits.MIN_RATE, limits.MAX_FLOPS),
    (("device", "peak_flops", "fp32"), "float", limits.MIN_RATE, limits.MAX_FLOPS),
    (("device", "memory_bandwidth_bytes_per_s"), "float", limits.MIN_RATE, limits.MAX_BYTES_PER_S),
    (("device", "matmul_efficiency"), "float", limits.MIN_EFFICIENCY, 1.0),
    (("device", "op_overhead_s"), "float", 0.0, limits.MAX_LATENCY_S),
    (("intra_node", "bandwidth_bytes_per_s"), "float", limits.MIN_RATE, limits.MAX_BYTES_PER_S),
    (("inter_node", "latency_s"), "float", 0.0, limits.MAX_LATENCY_S),
]
PLAN_FIELDS = [
    (("training", "global_batch"), "int", 1, limits.MAX_GLOBAL_BATCH),
    (("training", "micro_batch"), "int", 1, limits.MAX_GLOBAL_BATCH),
    (("training", "seq_len"), "int", 1, limits.MAX_SEQ_LEN),
    (("training", "dtype"), ("bf16", "fp16", "fp32"), None, None),
    *((("parallel", axis), "int", 1, limits.MAX_DEVICES) for axis in ("dp", "tp", "pp")),
    (("parallel", "virtual_stages"), "int", 1, limits.MAX_VIRTUAL_STAGES),
    (("parallel", "num_microbatches"), "int", 1, limits.MAX_GLOBAL_BATCH),
    (("parallel", "schedule"), ("gpipe", "1f1b", "interleaved-1f1b"), None, None),
    (("parallel", "recompute"), ("none", "selective", "full"), None, None),
    (("parallel", "zero"), (0, 1, 2, 3), None, None),
    (("parallel", "sequence_parallel"), "bool", None, None),
    (("parallel", "fused_kernels"), "bool", None, None),
    (("parallel", "sync_batchnorm"), "bool", None, None),
    (("placement", "order", 0), ("pp", "dp", "tp"), None, None),
    (("model", "name"), "str", None, None),
    (("model", "num_params"), "int", 0, limits.MAX_PARAMS),
    (("model", "num_layers"), "int", 0, limits.MAX_MODEL_OPS),
    (("stages", 0, "index"), "int", 0, limits.MAX_DEVICES * limits.MAX_VIRTUAL_STAGES),
    (("stages", 1, "num_params"), "int", 0, limits.MAX_PARAMS),
    (("stages", 0, "forward_s"), "float", 0.0, None),
    (("stages", 1, "memory_gib"), "float", 0.0, None),
    (("predicted", "step_time_s"), "float", 0.0, None),
    (("predicted", "memory_gib", 1), "float", 0.0, None),
    (("predicted", "comm_s", "dp"), "float", 0.0, None),
    *(
        (("cluster", *path), kind, low, high)
        for path, kind, low, high in CLUSTER_FIELDS
        if path != ("num_nodes",)
    ),
]
CLUSTER_MAPPINGS = [(), ("device",), ("device", "peak_flops"), ("intra_node",), ("inter_node",)]
# Not tensor_parallel: it maps any module path (so any key) to a style.
PLAN_MAPPINGS = [
    (),
    ("training",),
    ("parallel",),
    ("placement",),
    ("model",),
    ("stages", 1),
    ("predicted",),
    ("predicted", "comm_s"),
    *(("cluster", *path) for path in CLUSTER_MAPPINGS),
]


@functools.cache
def base_plan() -> dict:
    """A plan the planner wrote (pp 2, every section filled), as plain data."""
    model = hp.models.build("gpt-tiny")
    plan = hp.plan(
        model, hp.ClusterSpec.preset("cpu"), global_batch=16, seq_len=32, dtype="fp32", pp=2
    )
    return plan.to_dict()


def base_cluster() -> dict:
    return hp.ClusterSpec.preset("cpu").model_dump(mode="json")


def _set(data, path: tuple, value):
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


PLACEHOLDER = "__HYPARALLEL_FUZZ__"


@st.composite
def defective_yaml(draw, base: dict, fields: list, mappings: list) -> bytes:
    """The YAML bytes of ``base`` with exactly one defect."""
    data = copy.deepcopy(base)
    defect = draw(
        st.sampled_from(
            [
                "wrong type",
                "out of range",
                "out of range",
                "unknown key",
                "deep nesting",
                "duplicate key",
                "long number",
                "not UTF-8",
                "control character",
                "alias bomb",
                "not a mapping",
                "empty",
            ]
        )
    )  # numbers out of range twice as often: the main class
    path, kind, low, high = draw(st.sampled_from(fields))
    event(f"file: {defect}")
    if defect == "wrong type":
        _set(data, path, draw(WRONG_TYPE[kind] if isinstance(kind, str) else wrong_choice(kind)))
    elif defect == "out of range":
        if isinstance(kind, tuple) or low is None:
            _set(
                data,
                path,
                draw(wrong_choice(kind) if isinstance(kind, tuple) else WRONG_TYPE[kind]),
            )
        else:
            _set(data, path, draw(out_of_range(kind, low, high)))
    elif defect == "unknown key":
        _set(data, (*draw(st.sampled_from(mappings)), "zz_" + draw(WORDS)), draw(SMALL_JSON))
    elif defect in ("deep nesting", "long number"):
        _set(data, path, PLACEHOLDER)
    text = dump_yaml(data)
    if defect == "deep nesting":
        depth = draw(st.integers(limits.MAX_YAML_DEPTH + 1, 20_000))
        opened, closed = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
        text = text.replace(PLACEHOLDER, opened * depth + "1" + closed * depth)
    elif defect == "long number":
        text = text.replace(
            PLACEHOLDER, draw(st.sampled_from("123456789")) * draw(st.integers(1001, 5000))
        )
    elif defect == "duplicate key":
        lines = text.splitlines(keepends=True)
        keys = [i for i, line in enumerate(lines) if re.match(r"\s*[A-Za-z_][\w.*-]*:( |$)", line)]
        i = draw(st.sampled_from(keys))
        text = "".join(lines[: i + 1] + [lines[i]] + lines[i + 1 :])
    elif defect == "control character":
        at = draw(st.integers(0, len(text)))
        text = (
            text[:at]
            + draw(st.sampled_from(["\x00", "\x01", "\x1b", "\x7f", "\ufffe"]))
            + text[at:]
        )
    elif defect == "alias bomb":
        fanout = draw(st.integers(10, 30))
        levels = draw(st.integers(6, 9))
        text = (
            "a0: &a0 ["
            + ", ".join(["x"] * fanout)
            + "]\n"
            + "".join(
                f"a{j + 1}: &a{j + 1} [{', '.join([f'*a{j}'] * fanout)}]\n" for j in range(levels)
            )
        )
    elif defect == "not a mapping":
        text = draw(
            st.sampled_from(
                [
                    "- 1\n- 2\n",
                    "just a sentence\n",
                    "42\n",
                    "[training, parallel]\n",
                    "~\n",
                    "'quoted'\n",
                    "--- 3.5\n",
                    "!!binary aGVsbG8=\n",
                ]
            )
        )
    elif defect == "empty":
        text = draw(st.sampled_from(["", "\n\n", "# a comment only\n", "---\n", "   \n"]))
    raw = text.encode()
    if defect == "not UTF-8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(max_size=8)) + b"\xff" + raw[at:]
    return raw


# ---- plan files and cluster files ----------------------------------------------------------------

PLAN_COMMANDS = [
    lambda plan, out: ["show", plan],
    lambda plan, out: ["show", plan, "--yaml"],
    lambda plan, out: ["simulate", plan],
    lambda plan, out: ["simulate", plan, "--out", out],
]


@settings(FUZZ, max_examples=160)
@given(
    content=st.deferred(lambda: defective_yaml(base_plan(), PLAN_FIELDS, PLAN_MAPPINGS)),
    command=st.sampled_from(PLAN_COMMANDS),
    existed=st.booleans(),
)
def test_bad_plan_files_are_refused_in_one_line(content, command, existed):
    with tempfile.TemporaryDirectory() as folder:
        plan, out = Path(folder) / "plan.yaml", Path(folder) / "pictures" / "step.png"
        out.parent.mkdir()
        plan.write_bytes(content)
        if existed:
            out.write_text(SENTINEL)
        argv = command(str(plan), str(out))
        assert_refused(argv, out if "--out" in argv else None, existed)


CLUSTER_COMMANDS = [
    lambda cluster, out: [
        "plan",
        "--model",
        "gpt-tiny",
        "--gpus",
        "8",
        "--cluster",
        cluster,
        "--global-batch",
        "16",
        "--seq-len",
        "32",
        "-o",
        out,
    ],
    lambda cluster, out: [
        "calibrate",
        "--quick",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--base",
        cluster,
        "--out",
        out,
    ],
]


@settings(FUZZ, max_examples=60)
@given(
    content=defective_yaml(base_cluster(), CLUSTER_FIELDS, CLUSTER_MAPPINGS),
    command=st.sampled_from(CLUSTER_COMMANDS),
    existed=st.booleans(),
)
def test_bad_cluster_files_are_refused_in_one_line(content, command, existed):
    with tempfile.TemporaryDirectory() as folder:
        cluster, out = Path(folder) / "cluster.yaml", Path(folder) / "out" / "written.yaml"
        out.parent.mkdir()
        cluster.write_bytes(content)
        if existed:
            out.write_text(SENTINEL)
        assert_refused(command(str(cluster), str(out)), out, existed)


# ---- command lines -------------------------------------------------------------------------------


def plan_argv(folder: Path) -> list[str]:
    return [
        "plan",
        "--model",
        "gpt-tiny",
        "--gpus",
        "8",
        "--cluster",
        "cpu",
        "--global-batch",
        "16",
        "--seq-len",
        "32",
        "-o",
        str(folder / "out" / "plan.yaml"),
    ]


def trace_argv(folder: Path) -> list[str]:
    return ["trace", "--model", "gpt-tiny", "--seq-len", "32", "--batch-size", "1"]


NUMERIC_FLAGS = [  # (command, flag, bound): hyparallel.spec.limits'
    ("plan", "--gpus", limits.MAX_DEVICES),
    ("plan", "--gpus-per-node", limits.MAX_GPUS_PER_NODE),
    ("plan", "--global-batch", limits.MAX_GLOBAL_BATCH),
    ("plan", "--seq-len", limits.MAX_SEQ_LEN),
    ("plan", "--tp", limits.MAX_DEVICES),
    ("plan", "--pp", limits.MAX_DEVICES),
    ("plan", "--dp", limits.MAX_DEVICES),
    ("plan", "--ep", limits.MAX_DEVICES),
    ("check", "--ep", limits.MAX_GPUS_PER_NODE),
    ("plan", "--cp", limits.MAX_DEVICES),
    ("check", "--cp", limits.MAX_GPUS_PER_NODE),
    ("plan", "--top", limits.MAX_TOP),
    ("plan", "--powersgd-rank", limits.MAX_POWERSGD_RANK),
    # from 2: "1" is never drawn as bad
    ("plan", "--powersgd-start-step", limits.MAX_POWERSGD_START_STEP),
    ("plan", "--ps-servers", limits.MAX_DEVICES),
    ("trace", "--batch-size", limits.MAX_GLOBAL_BATCH),
    ("trace", "--seq-len", limits.MAX_SEQ_LEN),
    ("calibrate", "--nproc", limits.MAX_GPUS_PER_NODE),
    ("check", "--steps", 100),
    ("check", "--timeout", 3600),
]
COMMANDS = (
    "models",
    "clusters",
    "show",
    "trace",
    "plan",
    "demo",
    "checkpoint",
    "calibrate",
    "simulate",
    "check",
)


def _int_in_range(text: str, bound: int) -> bool:
    try:
        return 1 <= int(text) <= bound
    except ValueError:
        return False


@st.composite
def bad_number(draw, bound: int) -> str:
    value = draw(
        st.one_of(
            st.integers(max_value=0).map(str),
            st.integers(bound + 1, bound + 10**6).map(str),
            st.integers(20, 6000).map(lambda k: "9" * k),
            st.floats(allow_nan=True).map(repr),
            st.text(max_size=10),
            st.sampled_from(["", " ", "1e3", "0x10", "８", "1_0", "--", "-"]),
        )
    )
    # "８" and "1_0" are ints to Python; keep it bad
    return "1" * 5000 if _int_in_range(value, bound) else value


# setting -> strategy of values out of its range or of the wrong type (gpt-tiny: hidden 64)
GPT_SETTINGS = {
    "num_layers": st.sampled_from(
        ["0", "-1", str(limits.MAX_LAYERS + 1), "10**12", "1e3", "abc", "2.0", "true"]
    ),
    "hidden_size": st.sampled_from(
        ["0", "-64", str(limits.MAX_HIDDEN + 1), "9" * 2000, "{a: 1}", "null"]
    ),
    "num_heads": st.sampled_from(["0", "65", "-4", "four", "[" * 100]),
    "vocab_size": st.sampled_from(["0", str(limits.MAX_VOCAB + 1), "1.5"]),
    "max_seq_len": st.sampled_from(["0", str(limits.MAX_SEQ_LEN + 1), "~x"]),
    "ffn_hidden_size": st.sampled_from(["0", str(limits.MAX_FFN_HIDDEN + 1), "wide"]),
    "dropout": st.sampled_from(["1.0", "1.5", "-0.1", ".nan", "high"]),
    "norm_eps": st.sampled_from(["0", "-1e-5", ".inf", "2"]),
    "bias": st.sampled_from(["maybe", "2", "[]"]),
}


@st.composite
def defective_argv(draw, folder: Path) -> tuple[list[str], Path | None]:
    """A working command line with one defect, and the output path it must not write (if it has
    one)."""
    defect = draw(
        st.sampled_from(
            [
                "numeric flag",
                "numeric flag",
                "unknown flag",
                "unknown command",
                "missing argument",
                "model spec",
                "model spec",
                "output path",
                "cluster",
                "dtype",
                "checkpoint",
            ]
        )
    )
    event(f"command line: {defect}")
    plan_out = folder / "out" / "plan.yaml"
    if defect == "numeric flag":
        command, flag, bound = draw(st.sampled_from(NUMERIC_FLAGS))
        base = {
            "plan": plan_argv(folder),
            "trace": trace_argv(folder),
            "calibrate": [
                "calibrate",
                "--quick",
                "--device",
                "cpu",
                "--out",
                str(folder / "out" / "c.yaml"),
            ],
            "check": ["check", "gpt-tiny", "--tp", "2", "--pp", "1"],
        }[command]
        value = draw(bad_number(bound))
        if flag in base:
            argv = [value if i and base[i - 1] == flag else word for i, word in enumerate(base)]
        else:
            argv = [*base, flag, value]
        return argv, plan_out if command == "plan" else None
    if defect == "unknown flag":
        base = draw(
            st.sampled_from(
                [plan_argv(folder), trace_argv(folder), ["models"], ["clusters", "--json"]]
            )
        )
        at = draw(st.integers(0, len(base)))
        return [*base[:at], "--no-such-" + draw(WORDS), *base[at:]], (
            plan_out if base[0] == "plan" else None
        )
    if defect == "unknown command":
        word = draw(
            st.text(max_size=12).filter(lambda w: w not in COMMANDS and not w.startswith("-"))
        )
        return [word, *draw(st.sampled_from([[], ["--gpus", "8"], ["x.yaml"]]))], None
    if defect == "missing argument":
        base = plan_argv(folder)
        drop = draw(st.sampled_from(["--model", "--gpus"]))
        at = base.index(drop)
        return base[:at] + base[at + 2 :], plan_out
    if defect == "model spec":
        setting = draw(st.sampled_from([*GPT_SETTINGS, "zz_unknown"]))
        value = draw(GPT_SETTINGS[setting]) if setting in GPT_SETTINGS else "1"
        name = draw(st.sampled_from(["gpt-tiny", "gpt-tiny", "no-such-model", "hf:NoSuchArch"]))
        base = draw(st.sampled_from([plan_argv(folder), trace_argv(folder)]))
        at = base.index("gpt-tiny")
        spec = [name, f"{setting}={value}"] if name == "gpt-tiny" else [name]
        return [*base[:at], *spec, *base[at + 1 :]], plan_out if base[0] == "plan" else None
    if defect == "output path":
        bad = draw(
            st.sampled_from(
                [folder / "missing" / "plan.yaml", folder, folder / "out" / "x" / "y.yaml"]
            )
        )
        base = plan_argv(folder)
        return [*base[:-1], str(bad)], None
    if defect == "cluster":
        return [
            *plan_argv(folder)[:6],
            "no-such-preset-" + draw(WORDS),
            *plan_argv(folder)[7:],
        ], plan_out
    if defect == "dtype":
        dtype = draw(st.text(max_size=6).filter(lambda t: t not in ("bf16", "fp16", "fp32")))
        return [*plan_argv(folder), "--dtype", dtype], plan_out
    checkpoint_out = folder / "out" / "model.pt"
    # a folder with no checkpoint, or none at all
    source = folder / draw(st.sampled_from(["", "no-such-dir"]))
    return ["checkpoint", "export", str(source), str(checkpoint_out)], checkpoint_out


@settings(FUZZ, max_examples=160)
@given(data=st.data(), existed=st.booleans())
def test_bad_command_lines_are_refused_in_one_line(data, existed):
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "out").mkdir()
        argv, output = data.draw(defective_argv(folder))
        if output is not None and existed:
            output.write_text(SENTINEL)
        assert_refused(argv, output, existed and output is not None)


# ---- the starting points are valid: each defect alone is what the CLI refuses --------------------


def test_the_starting_points_are_valid(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(dump_yaml(base_plan()))
    for argv in (["show", str(plan)], ["simulate", str(plan)]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(dump_yaml(base_cluster()))
    (tmp_path / "out").mkdir()
    argv = plan_argv(tmp_path)
    code, _, err = run_cli([*argv[:6], str(cluster), *argv[7:]])
    assert code == 0 and (tmp_path / "out" / "plan.yaml").exists(), err
    code, _, err = run_cli(trace_argv(tmp_path))
    assert code == 0, err


@pytest.mark.parametrize("flag", [flag for _, flag, _ in NUMERIC_FLAGS])
def test_every_numeric_flag_is_fuzzed(flag):
    from hyparallel.cli import build_parser

    # argparse keeps its subcommands there
    commands = build_parser()._subparsers._group_actions[0].choices
    options = {
        option
        for command in commands.values()
        for action in command._actions
        for option in action.option_strings
        if getattr(action.type, "__name__", "") == "parse"
    }
    assert flag in options
    # a numeric flag added later must join NUMERIC_FLAGS
    assert options <= {f for _, f, _ in NUMERIC_FLAGS}
    unbounded = [
        option
        for command in commands.values()
        for action in command._actions
        for option in action.option_strings
        if action.type in (int, float)
    ]
    # every numeric flag takes a bounded type (cli._int_in), never a bare int or float
    assert not unbounded
