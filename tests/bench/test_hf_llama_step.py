"""benchmarks/hf_llama_step.py on the CPU at its tiny size: the variants run, kf.patch changes
the model and not its first loss, a failing variant is reported, not raised."""
import torch

from tests.bench.scripts import load_script


def test_variants_give_the_same_first_loss(capsys):
    script = load_script("hf_llama_step")
    device = torch.device("cpu")
    eager = script.run_variant("eager", "tiny", 2, device, torch.float32)
    patched = script.run_variant("kf", "tiny", 2, device, torch.float32)
    # kernelforge.transformers: 2 norms, the MLP and the attention a layer, the final norm, the head,
    # the model's attention implementation and its loss
    assert patched["note"] == "12 modules replaced, 0 skipped"
    torch.testing.assert_close(patched["first_loss"], eager["first_loss"], rtol=1e-5, atol=1e-5)
    assert eager["step_ms"] > 0 and patched["step_ms"] > 0


def test_a_failing_variant_is_reported(capsys):
    script = load_script("hf_llama_step")
    assert script.main(["--size", "tiny", "--variants", "eager,nonsense", "--steps", "1", "--device", "cpu",
                        "--dtype", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "nonsense         failed: ValueError: unknown variant 'nonsense'" in out
    assert "eager" in out and "1.00x" in out
