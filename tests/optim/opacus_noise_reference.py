"""Opacus's noise calibration for DP-SGD (opacus.accountants.utils.get_noise_multiplier, RDP).

Input (argv[1], JSON): {"settings": [{"epsilon": e, "delta": d, "rate": q, "steps": n}, ...]}.
Output (stdout, JSON): per setting {"noise_multiplier": z}, found to within epsilon 0.001.
"""

import json
import sys
import warnings

from opacus.accountants.utils import get_noise_multiplier


def main():
    warnings.simplefilter("ignore")  # "optimal order is the smallest/largest alpha"
    spec = json.load(open(sys.argv[1]))
    out = []
    for s in spec["settings"]:
        z = get_noise_multiplier(target_epsilon=s["epsilon"], target_delta=s["delta"],
                                 sample_rate=s["rate"], steps=s["steps"], accountant="rdp",
                                 epsilon_tolerance=0.001)
        out.append({"noise_multiplier": float(z)})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
