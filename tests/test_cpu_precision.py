"""An explicit bf16 request on a CPU without native bf16 (no AVX512-BF16, no AMX: torch's reference
kernel, many times slower than fp32) is warned about before any work starts, naming the CPU's
capability, the slowdown and the fix; on a CPU with native bf16, and for fp32 or auto, nothing is
said. The CPU is injected (`Cpu`), so these run on any machine, and nothing here computes in bf16."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import save_model_file
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.config.train import TrainConfig
from nmt_cli.inference.translate import load_translator
from nmt_cli.model import cpu as cpu_module
from nmt_cli.model.cpu import Cpu, bf16_speedup, slow_bf16_warning, this_cpu
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import distributed
from nmt_cli.training import train as train_module

AVX2_ONLY = Cpu("AVX2", frozenset({"sse4_2", "avx", "avx2", "fma"}))
SAPPHIRE_RAPIDS = Cpu("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}), 5.6)
# The flags, but bf16 products measured slower than fp32 (as on one CI machine)
FLAGS_BUT_SLOW = Cpu("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16"}), 0.4)


def test_the_warning_names_the_capability_the_slowdown_and_the_fix() -> None:
    message = slow_bf16_warning("--precision bf16", "--precision auto", AVX2_ONLY)
    assert message is not None
    for needle in ("--precision bf16", "torch CPU capability AVX2", "CPU flags: avx2",
                   "no avx512_bf16 or amx_bf16", "4-50x slower than fp32", "use --precision auto"):
        assert needle in message, (needle, message)
    assert slow_bf16_warning("--precision bf16", "--precision auto", SAPPHIRE_RAPIDS) is None
    assert AVX2_ONLY.native_bf16 is False and SAPPHIRE_RAPIDS.native_bf16 is True
    assert not AVX2_ONLY.fast_bf16 and SAPPHIRE_RAPIDS.fast_bf16 and not FLAGS_BUT_SLOW.fast_bf16
    message = slow_bf16_warning("--dtype bf16", "--dtype auto", FLAGS_BUT_SLOW)
    assert message is not None and "measured no faster than fp32" in message and "0.40x fp32" in message


@pytest.mark.parametrize(("cpu", "chosen"), [(AVX2_ONLY, "fp32"), (FLAGS_BUT_SLOW, "fp32"),
                                             (SAPPHIRE_RAPIDS, "bf16")])
def test_auto_precision_trains_in_bf16_only_where_it_measured_faster(
        monkeypatch: pytest.MonkeyPatch, cpu: Cpu, chosen: str) -> None:
    monkeypatch.setattr(distributed, "this_cpu", lambda: cpu)
    cfg = TrainConfig(data=Path("bin"), save_dir=Path("run"), precision="auto", device="cpu")
    assert distributed.resolve_precision(cfg, torch.device("cpu")) == chosen
    assert distributed.resolve_precision(replace(cfg, precision="bf16"), torch.device("cpu")) == "bf16"


def test_the_measurement_is_a_ratio_of_real_products() -> None:
    """Tiny shapes, so this is quick on any CPU; the ratio is positive and finite."""
    assert 0 < bf16_speedup(rows=16, inner=16, cols=16) < float("inf")


def test_this_cpu_is_what_torch_and_cpuinfo_say() -> None:
    cpu = this_cpu()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    if Path("/proc/cpuinfo").exists():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
        assert cpu.flags == frozenset(flags.partition(":")[2].split())


@pytest.mark.parametrize(("precision", "cpu", "warned"), [
    ("bf16", AVX2_ONLY, True), ("bf16", SAPPHIRE_RAPIDS, False), ("auto", AVX2_ONLY, False),
    ("fp32", AVX2_ONLY, False)])
def test_train_warns_before_any_work(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                     precision: str, cpu: Cpu, warned: bool) -> None:
    monkeypatch.setattr(cpu_module, "this_cpu", lambda: cpu)
    said_before_work: list[str] = []
    monkeypatch.setattr(train_module, "train", lambda cfg: said_before_work.append(capsys.readouterr().err))
    train_module.run(TrainConfig(data=Path("bin"), save_dir=Path("run"), precision=precision, device="cpu"))
    assert len(said_before_work) == 1
    assert ("warning: --precision bf16 on a CPU without native bf16" in said_before_work[0]) == warned
    assert ("--precision auto" in said_before_work[0]) == warned


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory, toy_spm) -> Path:
    spm_bytes, dictionary = toy_spm
    torch.manual_seed(0)
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, heads=2),
                        len(dictionary)).eval()
    path = tmp_path_factory.mktemp("cpu_precision") / "model.pt"
    return save_model_file(path, model, dictionary, spm_bytes)


@pytest.mark.parametrize(("dtype", "cpu", "warned"), [
    ("bf16", AVX2_ONLY, True), ("bf16", SAPPHIRE_RAPIDS, False), ("auto", AVX2_ONLY, False)])
def test_translate_warns_on_such_a_cpu(model_path: Path, dtype: str, cpu: Cpu,
                                                  warned: bool) -> None:
    said: list[str] = []
    translator = load_translator(TranslateConfig(model=model_path, dtype=dtype, device="cpu", threads=1),
                                 said.append, cpu)
    translator.close()
    assert [m for m in said if "--dtype bf16 on a CPU without native bf16" in m and "--dtype auto" in m] == (
        said[:1] if warned else [])


@pytest.mark.parametrize(("cpu", "d_model", "beam", "expected"), [
    (SAPPHIRE_RAPIDS, 256, 4, torch.bfloat16), (SAPPHIRE_RAPIDS, 128, 4, torch.bfloat16),
    (SAPPHIRE_RAPIDS, 128, 1, torch.float32), (SAPPHIRE_RAPIDS, 256, 1, torch.bfloat16),
    (FLAGS_BUT_SLOW, 256, 4, torch.float32), (AVX2_ONLY, 512, 4, torch.float32)])
def test_auto_translates_in_bf16_on_fast_bf16_but_narrow_greedy_in_fp32(
        tmp_path: Path, toy_spm, cpu: Cpu, d_model: int, beam: int, expected: torch.dtype) -> None:
    """`--dtype auto` on the CPU: bf16 where the CPU measured fast bf16 products, at every width for a
    beam search, from d_model 256 for greedy search; fp32 elsewhere (benchmarks/README.md)."""
    spm_bytes, dictionary = toy_spm
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=d_model, d_ff=32, heads=2),
                        len(dictionary)).eval()
    path = save_model_file(tmp_path / "model.pt", model, dictionary, spm_bytes)
    translator = load_translator(TranslateConfig(model=path, device="cpu", threads=1, beam=beam),
                                 lambda _: None, cpu)
    translator.close()
    assert next(translator.model.parameters()).dtype == expected


def test_every_benchmark_table_starts_with_the_machine_and_its_cpu_capability() -> None:
    """benchmarks/machine.py's line names torch's CPU capability and the bf16 flags; every script
    that prints a table of measurements prints it."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    machine = (folder / "machine.py").read_text()
    assert "get_cpu_capability()" in machine and '"avx512_bf16", "amx_bf16"' in machine
    # averaging_span.py is arithmetic on the schedule: it measures nothing on any machine
    scripts = [p for p in folder.glob("*.py") if p.name not in ("machine.py", "averaging_span.py")]
    assert len(scripts) >= 7 and all("describe()" in p.read_text() for p in scripts), scripts
