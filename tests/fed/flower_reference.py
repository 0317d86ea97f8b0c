"""Runs Flower's server strategies on given client updates and prints the new global weights.

Input (argv[1], JSON): {"strategy": name, "options": {...}, "initial": [[floats] per tensor],
"rounds": [[{"weights": [[floats] per tensor], "tokens": int} per client] per round]}.
Output (stdout, JSON): [[[floats] per tensor] per round], the weights after each round.
Exit 3 when flwr is not installed (the test then skips).
"""

import json
import sys

try:
    import numpy as np
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import strategy as fs
except ImportError as e:  # pragma: no cover
    print(f"flwr unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    spec = json.load(open(sys.argv[1]))
    initial = [np.asarray(t, dtype=np.float64) for t in spec["initial"]]
    init_params = ndarrays_to_parameters(initial)
    o = spec["options"]
    name = spec["strategy"]
    common = dict(min_fit_clients=1, min_available_clients=1, min_evaluate_clients=1)
    if name == "fedavg":
        s = fs.FedAvg(initial_parameters=init_params, inplace=False, **common)
    elif name == "fedavgm":
        s = fs.FedAvgM(initial_parameters=init_params, server_learning_rate=o["lr"],
                       server_momentum=o["momentum"], **common)
    elif name == "fedadam":
        s = fs.FedAdam(initial_parameters=init_params, eta=o["lr"], beta_1=o["beta1"],
                       beta_2=o["beta2"], tau=o["tau"], **common)
    elif name == "fedyogi":
        s = fs.FedYogi(initial_parameters=init_params, eta=o["lr"], beta_1=o["beta1"],
                       beta_2=o["beta2"], tau=o["tau"], **common)
    elif name == "fedadagrad":
        s = fs.FedAdagrad(initial_parameters=init_params, eta=o["lr"], tau=o["tau"], **common)
    elif name == "fedmedian":
        s = fs.FedMedian(initial_parameters=init_params, **common)
    elif name == "fedtrimmedavg":
        s = fs.FedTrimmedAvg(initial_parameters=init_params, beta=o["beta"], **common)
    elif name == "krum":
        s = fs.Krum(initial_parameters=init_params, num_malicious_clients=o["num_malicious"],
                    num_clients_to_keep=o["to_keep"], **common)
    else:
        raise SystemExit(f"no Flower strategy {name}")
    out = []
    for rnd, clients in enumerate(spec["rounds"], start=1):
        results = []
        for c in clients:
            w = [np.asarray(t, dtype=np.float64) for t in c["weights"]]
            res = FitRes(status=Status(code=Code.OK, message=""),
                         parameters=ndarrays_to_parameters(w), num_examples=c["tokens"], metrics={})
            results.append((None, res))
        params, _ = s.aggregate_fit(rnd, results, [])
        out.append([a.astype(np.float64).ravel().tolist() for a in parameters_to_ndarrays(params)])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
