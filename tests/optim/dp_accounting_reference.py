"""Google's dp_accounting RDP accountant for sampling without replacement on a grid of settings.

Input (argv[1], JSON): {"settings": [{"noise": z, "clients": n, "sample": m, "steps": s,
"delta": d}, ...], "orders": [alpha, ...]}. Each setting composes `steps` releases of the Gaussian
mechanism of multiplier z on m of n records drawn without replacement (neighbouring datasets: one
record replaced). Output (stdout, JSON): per setting {"epsilon": e, "order": a, "rdp": [RDP of
one step at each given order]}. One step's RDP is computed once per (noise, clients, sample)
and scaled by the steps, as RdpAccountant.compose does for a count.
"""

import json
import sys

from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp


def main():
    spec = json.load(open(sys.argv[1]))
    orders = spec["orders"]
    out = []
    one_step = {}
    for s in spec["settings"]:
        key = (s["noise"], s["clients"], s["sample"])
        if key not in one_step:
            accountant = rdp.RdpAccountant(
                orders, neighboring_relation=rdp.NeighborRel.REPLACE_ONE)
            accountant.compose(dp_event.SampledWithoutReplacementDpEvent(
                source_dataset_size=s["clients"], sample_size=s["sample"],
                event=dp_event.GaussianDpEvent(s["noise"])))
            one_step[key] = accountant._rdp
        # Composition adds RDP: steps releases are steps times one (as RdpAccountant composes).
        eps, order = rdp.compute_epsilon(orders, one_step[key] * s["steps"], s["delta"])
        out.append({"epsilon": float(eps), "order": float(order),
                    "rdp": [float(v) for v in one_step[key]]})
    json.dump(out, sys.stdout)

if __name__ == "__main__":
    main()
