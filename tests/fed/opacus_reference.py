"""Opacus's RDP accountant (opacus.accountants.analysis.rdp) on a grid of settings.

Input (argv[1], JSON): {"settings": [{"noise": z, "rate": q, "steps": n, "delta": d}, ...],
"orders": [alpha, ...]}. Output (stdout, JSON): per setting {"epsilon": e, "order": a,
"rdp": [RDP of one step at each given order]}.
"""

import json
import sys

from opacus.accountants.analysis import rdp
from opacus.accountants import RDPAccountant


def main():
    spec = json.load(open(sys.argv[1]))
    out = []
    for s in spec["settings"]:
        acc = RDPAccountant()
        acc.history = [(s["noise"], s["rate"], s["steps"])]
        eps, order = acc.get_privacy_spent(delta=s["delta"])
        one = rdp.compute_rdp(q=s["rate"], noise_multiplier=s["noise"], steps=1,
                              orders=spec["orders"])
        out.append({"epsilon": float(eps), "order": float(order), "rdp": [float(v) for v in one]})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
