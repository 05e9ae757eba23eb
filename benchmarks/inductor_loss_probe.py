import copy, torch, torch._inductor.config as ic
from tests.models.test_transformer_models import randomize, tiny_lm
torch.manual_seed(0)
model = randomize(tiny_lm()).cuda()
for shape in [(3, 12), (2, 17), (4, 33)]:
    ids = torch.randint(0, 61, shape, device="cuda")
    for dynamic, opts in ((None, {}), (True, {}), (True, {"triton.coalesce_tiling_analysis": False})):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        f = torch.compile(lambda i: m.compute_loss(i), dynamic=dynamic, options=opts or None)
        try:
            f(ids).backward(); print(shape, "dynamic" if dynamic else "static", opts, "ok")
        except Exception as e:
            print(shape, "dynamic" if dynamic else "static", opts, "FAILED", type(e).__name__, str(e).splitlines()[0][:150])
# the loss alone
for rows, v in [(33, 61), (34, 61), (33, 64), (1008, 256)]:
    for opts in ({}, {"triton.coalesce_tiling_analysis": False}):
        torch._dynamo.reset()
        x = torch.randn(rows, 48, device="cuda", requires_grad=True); w = torch.randn(v, 48, device="cuda", requires_grad=True)
        t = torch.randint(0, v, (rows,), device="cuda")
        f = torch.compile(lambda x, w: torch.nn.functional.cross_entropy((x @ w.t()).float(), t), options=opts or None)
        try:
            f(x, w).backward(); print("loss alone", rows, v, opts, "ok")
        except Exception as e:
            print("loss alone", rows, v, opts, "FAILED", type(e).__name__)
