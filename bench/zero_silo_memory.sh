#!/usr/bin/env bash
# Peak memory of a federated silo run as 2 ZeRO-1 ranks that share second and first moments
# (bench/README.md, "Data parallel"): a server and one client (`mpirun -np 2`, no state folder)
# train 2 rounds of 2 local steps of a ~51M-parameter Llama (206 MB of f32 weights); each rank's
# peak resident memory as GNU time reports it.
# Usage: bench/zero_silo_memory.sh MANIFEST [POLLEN]   (a manifest with vocab_size <= 2048)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/bin/time ] || { echo "needs GNU time: apt-get install time" >&2; exit 1; }
manifest=$(realpath "$1")
pollen=$(realpath "${2:-build/pollen}")
work=build/bench-zero-silo
rm -rf "$work"
mkdir -p "$work"
work=$(realpath "$work")
fingerprint=$(grep -o '"fingerprint": *"[^"]*"' "$manifest" | head -1 | sed 's/.*: *"//; s/"$//')
port=$((21000 + RANDOM % 1000))
model="[model]
vocab_size = 2048
hidden_size = 1024
intermediate_size = 2816
num_hidden_layers = 4
num_attention_heads = 16
num_key_value_heads = 8
max_position_embeddings = 128
[tokenizer]
fingerprint = \"$fingerprint\""
cat > "$work/fed.toml" <<TOML
[server]
dir = "$work/server"
address = "127.0.0.1:$port"
rounds = 2
local_steps = 2
wait_for_clients_s = 60
[strategy]
name = "diloco"
second_moments = "factored"
first_moments = "output"
$model
TOML
cat > "$work/client.toml" <<TOML
[client]
id = "silo-0"
server = "127.0.0.1:$port"
threads = 1
[data]
manifests = ["$manifest"]
[train]
micro_batch = 2
accumulation = 2
seq = 64
eval_batches = 1
[parallel]
zero = 1
bucket_mb = 25
timeout_s = 600
$model
TOML
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
"$pollen" fed server --config "$work/fed.toml" > "$work/server.log" 2>&1 &
server=$!
mpirun --oversubscribe --bind-to none "${root[@]}" -np 2 bash -c \
  "/usr/bin/time -f \"rank \$OMPI_COMM_WORLD_RANK: peak resident memory %M KiB\" \
   '$pollen' fed client --config '$work/client.toml'" > "$work/client.log" 2>&1
wait "$server"
grep "peak resident memory" "$work/client.log" | sort
