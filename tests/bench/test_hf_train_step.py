"""benchmarks/tools/hf_train_step.py on the CPU at its tiny size: the variants run, kf.patch changes
the model and not its first loss (Llama, Qwen3, Gemma 3), a failing variant is reported, not raised."""
import pytest
import torch

from tests.bench.scripts import load_script


# kernelforge.transformers: 2 norms, the MLP and the attention a layer, and the layer itself where its
# forward is Llama's (Qwen3 adds q / k norms; Gemma 3 those and two more norms around each block,
# its layer its own), the final norm, the head, the model's attention implementation and its loss
@pytest.mark.parametrize("model,replaced", [("llama", 14), ("qwen3", 18), ("gemma3", 20)])
def test_variants_give_the_same_first_loss(model, replaced):
    script = load_script("hf_train_step")
    device = torch.device("cpu")
    eager = script.run_variant("eager", model, "tiny", 2, device, torch.float32)
    patched = script.run_variant("kf", model, "tiny", 2, device, torch.float32)
    assert patched["note"] == f"{replaced} modules replaced, 0 skipped"
    torch.testing.assert_close(patched["first_loss"], eager["first_loss"], rtol=1e-5, atol=1e-5)
    assert eager["step_ms"] > 0 and patched["step_ms"] > 0


def test_a_failing_variant_is_reported(capsys):
    script = load_script("hf_train_step")
    assert script.main(["--size", "tiny", "--variants", "eager,nonsense", "--steps", "1", "--device", "cpu",
                        "--dtype", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "nonsense         failed: ValueError: unknown variant 'nonsense'" in out
    assert "eager" in out and "1.00x" in out


def test_under_autocast_the_patched_model_trains_as_eager():
    # --dtype amp: float32 weights under torch.autocast(bfloat16); kf.patch's first loss as eager's
    # to bfloat16's precision (its backward failed under autocast before bd04d01)
    script = load_script("hf_train_step")
    device = torch.device("cpu")
    eager = script.run_variant("eager", "llama", "tiny", 1, device, torch.float32, amp=True)
    patched = script.run_variant("kf", "llama", "tiny", 1, device, torch.float32, amp=True)
    torch.testing.assert_close(patched["first_loss"], eager["first_loss"], rtol=1e-2, atol=1e-2)
