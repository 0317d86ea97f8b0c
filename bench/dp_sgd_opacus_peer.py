"""Peer for bench/dp_sgd_vs_opacus.sh: DP-SGD steps of the CPU peer's decoders under Opacus.

Run: python dp_sgd_opacus_peer.py PEER_SCRIPT CONFIG MODE [threads] [steps] [batch] [seq]
  PEER_SCRIPT  ../shared/peers/pytorch_cpu_peer.py (its models, as bench/step_vs_pytorch.sh runs)
  MODE         hooks (per-sample gradients from layer hooks), ghost (fast gradient clipping:
               per-sample norms, then a second backward of the clipped loss) or functorch
  batch, seq   default: the config's; clip 1, noise multiplier 1
-> one JSON line: tokens_per_s of full steps (forward, per-sample clipping, noise, AdamW) on a
fixed batch of random tokens, every row one sequence whose mean token loss is clipped, as
`pollen bench step --dp-clip` runs them."""
import importlib.util, json, resource, sys, time

import torch, torch.nn.functional as F
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping


def load_peer(path):
    spec = importlib.util.spec_from_file_location("cpu_peer", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def main():
    peer = load_peer(sys.argv[1])
    name, mode = sys.argv[2], sys.argv[3]
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    clip, noise = 1.0, 1.0
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    arch, L, d, h, kvh, ffn, V, T, B = peer.CONFIGS[name]
    B = int(sys.argv[6]) if len(sys.argv) > 6 else B
    T = int(sys.argv[7]) if len(sys.argv) > 7 else T

    class Logits(peer.LM):  # the peer's decoder, returning logits: Opacus clips per row
        def forward(s, idx):
            x = s.emb(idx)
            for b in s.blocks:
                x = b(x)
            return s.head(s.nf(x))

    m = Logits(arch, L, d, h, kvh, ffn, V, T)
    idx = torch.randint(0, V, (B, T))
    tgt = torch.randint(0, V, (B, T))
    adamw = lambda params: torch.optim.AdamW(params, lr=3e-4)
    if mode == "ghost":
        gm = GradSampleModuleFastGradientClipping(m, max_grad_norm=clip, use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(adamw(gm.parameters()), noise_multiplier=noise,
                                              max_grad_norm=clip, expected_batch_size=B)
        token_loss = torch.nn.CrossEntropyLoss()  # Opacus takes it per token itself
        criterion = DPLossFastGradientClipping(gm, opt, token_loss, loss_reduction="mean")

        def step():
            # Each row's loss is the mean over its T tokens (the shape argument), as pollen's.
            loss = criterion(gm(idx).view(-1, V), tgt.view(-1), shape=(B, T))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        gm = GradSampleModule(m, force_functorch=mode == "functorch")
        opt = DPOptimizer(adamw(gm.parameters()), noise_multiplier=noise, max_grad_norm=clip,
                          expected_batch_size=B)

        def step():
            # The mean over every token: Opacus's "mean" reduction scales the per-sample gradients
            # by B, which makes each row's the gradient of its mean token loss.
            loss = F.cross_entropy(gm(idx).view(-1, V), tgt.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    dt = (time.perf_counter() - t0) / steps
    n_params = sum(p.numel() for p in m.parameters())
    print(json.dumps(dict(config=name, impl=f"opacus-{mode}", threads=threads,
                          params_M=round(n_params / 1e6, 2), batch=B, seq=T,
                          step_ms=round(dt * 1e3, 1), tokens_per_s=round(B * T / dt),
                          loss=round(loss.item(), 3),
                          peak_rss_MB=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))),
          flush=True)


if __name__ == "__main__":
    main()
