"""Opacus's RDP accountant (opacus.accountants.analysis.rdp) on a grid of settings.

Input (argv[1], JSON): {"settings": [{"noise": z, "rate": q, "steps": n, "delta": d}, ...],
"orders": [alpha, ...]}. Output (stdout, JSON): per setting {"epsilon": e, "order": a,
"rdp": [RDP of one step at each given order]}. The RDP of one step is computed once per (noise,
rate) and scaled by the steps, as RDPAccountant.get_privacy_spent does.
"""

import json
import sys
import warnings

from opacus.accountants.analysis import rdp


def main():
    warnings.simplefilter("ignore")  # "optimal order is the smallest/largest alpha"
    spec = json.load(open(sys.argv[1]))
    out = []
    one_step = {}
    for s in spec["settings"]:
        key = (s["noise"], s["rate"])
        if key not in one_step:
            one_step[key] = rdp.compute_rdp(q=s["rate"], noise_multiplier=s["noise"], steps=1,
                                            orders=spec["orders"])
        eps, order = rdp.get_privacy_spent(orders=spec["orders"], rdp=one_step[key] * s["steps"],
                                           delta=s["delta"])
        out.append({"epsilon": float(eps), "order": float(order),
                    "rdp": [float(v) for v in one_step[key]]})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
