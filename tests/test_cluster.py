"""ClusterSpec presets and files."""

from __future__ import annotations

import pytest

import hyparallel as hp
from hyparallel.spec.errors import ConfigError

REQUIRED = {"a100-80g", "h100-sxm", "h200", "cpu"}


def test_required_presets_exist_and_load():
    assert REQUIRED <= set(hp.ClusterSpec.presets())
    for name in hp.ClusterSpec.presets():
        spec = hp.ClusterSpec.preset(name)
        assert spec.name == name
        flops = spec.device.peak_flops
        assert flops.bf16 >= flops.fp32 and flops.tf32 >= flops.fp32
        # A device can move data faster inside a node than across nodes.
        assert spec.intra_node.bandwidth_bytes_per_s >= spec.inter_node.bandwidth_bytes_per_s


def test_preset_figures_match_datasheets():
    a100 = hp.ClusterSpec.preset("a100-80g")
    assert a100.device.peak_flops.bf16 == 312e12
    assert a100.device.memory_bytes == 80 * 2**30
    # NCCL-reachable share of 300 GB/s NVLink per direction
    assert a100.intra_node.bandwidth_bytes_per_s == 235e9
    assert a100.inter_node.bandwidth_bytes_per_s == 23e9  # ~92% of 200 Gb/s HDR per GPU
    h100 = hp.ClusterSpec.preset("h100-sxm")
    assert h100.device.peak_flops.bf16 == pytest.approx(989.4e12)
    h200 = hp.ClusterSpec.preset("h200")
    assert h200.device.memory_bytes > 140e9 and h200.device.memory_bandwidth_bytes_per_s == 4.8e12
    assert hp.ClusterSpec.preset("cpu").backend == "gloo"


def test_every_preset_figure_has_a_source_comment(repo):
    # Each preset gives the source of each of its figures in a comment.
    for path in sorted((repo / "configs" / "clusters").glob("*.yaml")):
        text = path.read_text()
        for field in (
            "peak_flops",
            "memory_bytes",
            "memory_bandwidth_bytes_per_s",
            "intra_node",
            "inter_node",
        ):
            lines = text.splitlines()
            index = next(i for i, line in enumerate(lines) if line.strip().startswith(field))
            window = "\n".join(lines[max(0, index - 3) : index + 8])
            assert "#" in window, f"{path.name}: no source comment near {field}"


def test_resize():
    spec = hp.ClusterSpec.preset("a100-80g", num_nodes=16)
    assert spec.num_gpus == 128 and spec.gpus_per_node == 8
    assert spec.device == hp.ClusterSpec.preset("a100-80g").device


def test_yaml_round_trip(tmp_path):
    spec = hp.ClusterSpec.preset("h200", num_nodes=4)
    spec.save(tmp_path / "c.yaml")
    assert hp.ClusterSpec.load(tmp_path / "c.yaml") == spec
    assert hp.ClusterSpec.resolve(str(tmp_path / "c.yaml")) == spec


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown cluster preset 'v100'.*a100-80g"):
        hp.ClusterSpec.preset("v100")


def test_bad_cluster_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        hp.ClusterSpec.preset("cpu")
        .to_yaml()
        .replace("memory_bytes: 3221225472", "memory_bytes: lots")
    )
    with pytest.raises(ConfigError) as info:
        hp.ClusterSpec.load(path)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"{path}: device.memory_bytes: expected a positive integer, got 'lots'"


def test_unknown_cluster_key_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(hp.ClusterSpec.preset("cpu").to_yaml() + "gpus: 8\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml: gpus: unknown key 'gpus'; expected one of: name, description"
    ):
        hp.ClusterSpec.load(path)


def _refused_after_edit(tmp_path, edit, expected):
    """The a100-80g preset with ``edit`` (old, new) applied is refused in one line naming the file
    and ``expected``."""
    text = hp.ClusterSpec.preset("a100-80g").to_yaml()
    assert edit[0] in text, edit[0]
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError) as info:
        hp.ClusterSpec.load(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and expected in message, message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("bf16: 3.12e+14", "bf16: .inf"),
            "device.peak_flops.bf16: expected a finite number, got .inf",
        ),
        (
            ("bf16: 3.12e+14", "bf16: .nan"),
            "device.peak_flops.bf16: expected a finite number, got .nan",
        ),
        (
            ("bf16: 3.12e+14", "bf16: 1.0e-300"),
            "device.peak_flops.bf16: expected a number of at least 1, got 1.0e-300",
        ),
        (
            ("bf16: 3.12e+14", "bf16: 1.0e+300"),
            "device.peak_flops.bf16: expected a number up to 1e+21, got 1.0e+300",
        ),
        (
            ("matmul_efficiency: 0.73", "matmul_efficiency: 0.0"),
            "matmul_efficiency: expected a number of at least 0.001",
        ),
        (
            ("latency_s: 5.0e-06", "latency_s: -1.0"),
            "intra_node.latency_s: expected a non-negative number, got -1.0",
        ),
        (
            ("reserved_bytes: 3221225472", "reserved_bytes: 85899345920"),
            (
                "device.reserved_bytes (85,899,345,920) must be less than memory_bytes"
                " (85,899,345,920)"
            ),
        ),
        (
            ("gpus_per_node: 8", "gpus_per_node: 4096"),
            "gpus_per_node: expected a positive integer up to 1,024, got 4096",
        ),
        (
            ("matmul_efficiency: 0.73", "matmul_efficiency: true"),
            "device.matmul_efficiency: expected a number, got true",
        ),
    ],
)
def test_cluster_figures_are_finite_and_bounded(tmp_path, edit, expected):
    _refused_after_edit(tmp_path, edit, expected)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"num_nodes": 0}, "cluster 'cpu': num_nodes: expected a positive integer, got 0"),
        (
            {"gpus_per_node": -8},
            "cluster 'cpu': gpus_per_node: expected a positive integer, got -8",
        ),
        (
            {"num_nodes": 2**20, "gpus_per_node": 8},
            "= 8,388,608 devices, more than the 1,048,576 hyparallel plans for",
        ),
    ],
)
def test_resizing_to_a_bad_size_is_one_line(sizes, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        hp.ClusterSpec.preset("cpu", **sizes)


def test_presets_fit_the_bounds_at_the_largest_size():
    from hyparallel.spec import limits

    spec = hp.ClusterSpec.preset("h200", num_nodes=limits.MAX_DEVICES // 8)
    assert spec.num_gpus == limits.MAX_DEVICES


def test_a_cluster_file_without_curves_loads_with_none(tmp_path):
    # Written before curves existed: no matmul_curve, attention_curve or kernel_floor_s. It loads,
    # and every matmul stays at matmul_efficiency (Note [matmul curve]).
    text = hp.ClusterSpec.preset("a100-80g").to_yaml()
    lines, skip = [], False
    for line in text.splitlines():
        if line.startswith(("  matmul_curve:", "  attention_curve:")):
            skip = True
            continue
        if skip and line.startswith("    "):
            continue
        skip = False
        if not line.startswith("  kernel_floor_s:"):
            lines.append(line)
    path = tmp_path / "old.yaml"
    path.write_text("\n".join(lines) + "\n")
    device = hp.ClusterSpec.load(path).device
    assert (
        device.matmul_curve is None
        and device.attention_curve is None
        and device.kernel_floor_s == 0.0
    )


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("half_k: 63.0", "half_k: lots"),
            "device.matmul_curve.half_k: expected a non-negative number, got 'lots'",
        ),
        (
            ("half_k: 63.0", "half_k: -1.0"),
            "device.matmul_curve.half_k: expected a non-negative number, got -1.0",
        ),
        (("    half_k: 63.0\n", ""), "device.matmul_curve.half_k: missing"),
        (
            ("    half_k: 63.0\n", "    half_k: 63.0\n    half_n: 1.0\n"),
            "device.matmul_curve.half_n: unknown key 'half_n'",
        ),
    ],
)
def test_a_malformed_curve_is_one_line_naming_the_field(tmp_path, edit, expected):
    _refused_after_edit(tmp_path, edit, expected)
