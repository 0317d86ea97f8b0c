#!/usr/bin/env bash
# bench/fed_vs_central: federated (DiLoCo) pre-training across language silos against the
# data-parallel baseline DiLoCo is measured against (bench/README.md records the results).
#
#   1. Silos by language from Debian's fortunes packages (German, Spanish, Italian, Russian,
#      Polish, Czech, Brazilian Portuguese, English), each input checked by SHA-256; each silo
#      curated on its own with `pollen data prepare` (5% held out).
#      A public silo besides them (pub): the English categories of Debian's `fortunes` that the
#      en silo does not hold, with the Bulgarian and Esperanto fortunes; no silo's data is in it.
#   2. One shared tokenizer trained federatedly: each silo sends only its pre-token counts.
#   2b. The shared warm-up (DiLoCo starts from a pre-trained model): `pollen train` for
#      WARMUP_STEPS steps (0: none, every run starts from random weights) on public data that is
#      no silo's: with WARMUP_SILO=man (the default) the translated manual pages of the silos'
#      languages (Debian's manpages-de, -es, -it, -ru, -pl, -cs, -pt-br, rendered with groff),
#      with WARMUP_SILO=pub the public silo above.
#   3. For N in CLIENTS (default "4 8"; the first N silos), each run of RUNS (default
#      "diloco-mix baseline") from the warm-up's checkpoint (model.init_from):
#        diloco-N       DiLoCo: Nesterov outer lr OUTER_LR, momentum OUTER_MOMENTUM (ramped
#                       up over MOMENTUM_WARMUP rounds), H local AdamW steps per round, ROUNDS
#                       rounds, fp32 both ways (OUTER picks
#                       another outer optimizer, ROW_WEIGHTING the strategy's row weighting,
#                       SECOND_MOMENTS whether the clients share their AdamW second moments,
#                       FIRST_MOMENTS which of their first moments they share)
#        diloco-CODEC-N the same with CODEC (int8, int4, nf3, nf2, mix, sign, topk) both ways: the
#                       pseudo-gradients with error feedback, the model download as a delta
#                       against the model the clients hold (BLOCK values per scale, TOPK kept
#                       per block, SCALE how each block's scale is stored: float32 or bf16,
#                       SERVER_CODEC for another codec on the way down)
#        baseline-N     one model, global batch N x local batch, ROUNDS x H steps, the same
#                       silos mixed equally (the same tokens), the same schedule, at the best
#                       peak learning rate of BASELINE_LRS: each is trained
#                       (baseline-lrLR-N) and the one with the lowest mean loss on the silos'
#                       held-out data is the baseline every run is compared with (a larger
#                       global batch takes a larger rate than a client's local batch does)
#      each evaluated with `pollen eval` on every silo's held-out data (the warm-up model too).
#   4. The table ($OUT/table.md) and `pollen plot` curves ($OUT/curves-N.svg).
#
# Communication of the baseline: every client sends and receives the full fp32 gradient once
# per step. Knobs (environment): CLIENTS, H, ROUNDS, SEQ, MICRO_BATCH, INNER_LR (the clients'
# peak rate), INNER_BETA1 and INNER_BETA2 (their AdamW betas; the baseline keeps 0.9 and 0.95),
# BASELINE_LRS (the baseline's candidates), MIN_LR,
# WARMUP, GRAD_CLIP (the gradient-norm clip of the clients' and the baseline's steps; 0: off),
# ROUND_WARMUP (clients' train.round_warmup_steps), DRIFT (their
# train.drift_correction), PROXIMAL_MU (their train.proximal_mu: FedProx), OUTER (strategy.name: diloco, fedadam, fedyogi, ...), OUTER_LR,
# OUTER_MOMENTUM, MOMENTUM_WARMUP (strategy.momentum_warmup_rounds), OUTER_BETA1, OUTER_BETA2,
# OUTER_TAU (-1: the strategy's default),
# ROW_WEIGHTING (strategy.row_weighting), SECOND_MOMENTS (strategy.second_moments: none or
# factored), FIRST_MOMENTS (strategy.first_moments: none, output or token_rows),
# EMBEDDING_LR_SCALE (strategy.embedding_lr_scale), WARMUP_STEPS, WARMUP_LR, WARMUP_SILO (pub or man),
# RUNS (which of diloco, diloco-CODEC, baseline), BLOCK, TOPK, SCALE, SERVER_CODEC, MODEL (the model file, default model.toml),
# POLLEN (the binary), THREADS (0: every core), SEED (the server's and the baseline's seed; the
# clients draw theirs from the server's), OUT. The defaults are the best configuration
# measured (bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLIENTS=${CLIENTS-"4 8"}
H=${H:-11}
ROUNDS=${ROUNDS:-91}
SEQ=${SEQ:-64}
MICRO_BATCH=${MICRO_BATCH:-4}
INNER_LR=${INNER_LR:-6e-3}
BASELINE_LRS=${BASELINE_LRS:-"3e-3 6e-3 8e-3 1.2e-2 1.6e-2"}
MIN_LR=${MIN_LR:-3e-4}
INNER_BETA1=${INNER_BETA1:-0.9}
INNER_BETA2=${INNER_BETA2:-0.95}
WARMUP=${WARMUP:-20}
GRAD_CLIP=${GRAD_CLIP:-1.0}
OUTER=${OUTER:-diloco}
OUTER_LR=${OUTER_LR:-1.0}
OUTER_MOMENTUM=${OUTER_MOMENTUM:-0.7}
MOMENTUM_WARMUP=${MOMENTUM_WARMUP:-10}
OUTER_BETA1=${OUTER_BETA1:--1}
OUTER_BETA2=${OUTER_BETA2:--1}
OUTER_TAU=${OUTER_TAU:--1}
ROW_WEIGHTING=${ROW_WEIGHTING:-target_counts}
SECOND_MOMENTS=${SECOND_MOMENTS:-factored}
FIRST_MOMENTS=${FIRST_MOMENTS:-output}
EMBEDDING_LR_SCALE=${EMBEDDING_LR_SCALE:-3}
ROUND_WARMUP=${ROUND_WARMUP:-0}
DRIFT=${DRIFT:-0.75}
PROXIMAL_MU=${PROXIMAL_MU:-0}
WARMUP_STEPS=${WARMUP_STEPS:-8000}
WARMUP_LR=${WARMUP_LR:-3e-3}
WARMUP_SILO=${WARMUP_SILO:-man}
RUNS=${RUNS:-"diloco-mix baseline"}
BLOCK=${BLOCK:-64}
TOPK=${TOPK:-4}
SCALE=${SCALE:-bf16}
THREADS=${THREADS:-0}
SEED=${SEED:-0}
OUT=$(realpath -m "${OUT:-out/bench/fed_vs_central}")
POLLEN=$(realpath "${POLLEN:-build/pollen}")
HERE=bench/fed_vs_central
MODEL=$(realpath "${MODEL:-$HERE/model.toml}")
STEPS=$((ROUNDS * H))

scripts/setup-deps bench
[ -x "$POLLEN" ] || scripts/build
mkdir -p "$OUT/counts" "$OUT/eval" "$OUT/configs"
START=$(date +%s)
step() { printf '\n== [%4ds] %s\n' "$(($(date +%s) - START))" "$*"; }

F=/usr/share/games/fortunes
LANGS=(de es it ru pl cs pt en)
declare -A SOURCES=(
  [de]="$F/de" [es]="$F/es" [it]="$F/it" [ru]="$F/ru" [pl]="$F/pl" [cs]="$F/cs"
  [pt]="$F/brasil"
  [en]="$F/fortunes $F/literature $F/people $F/wisdom $F/humorists $F/science $F/politics"
)
PUBLIC_CATEGORIES="art computers cookie debian definitions disclaimer drugs education ethnic food
  goedel kids knghtbrd law linux linuxcookie love magic medicine men-women miscellaneous news
  paradoxum perl pets platitudes pratchett riddles songs-poems sports startrek tao translate-me
  work zippy"
SOURCES[pub]="$(for c in $PUBLIC_CATEGORIES; do printf '%s ' "$F/$c"; done)$F/bg $F/eo"
# SHA-256 of each silo's input files (sorted by path, concatenated), Debian 12's packages.
declare -A EXPECTED_SHA256=(
  [de]=8ad737883ae62768e105015fa1f70dde4611186ea425200525eb8f0ca5471519
  [es]=1ed014e562f9e0bd452e6e2ab744e394398c05d7a0ef3fe43232ddd8b6a20d50
  [it]=eaa298eba4b95f377514a5855b2351f5a1d17e20f295018cc755f884ca39f3a1
  [ru]=a29df27b4089a541122300cd01bbb0d3ceebf12083bf4fe172544b5bc986e408
  [pl]=a585db3b318c09a6b9ac2b406b43096a9c7233181ff8770022d4ad97e187b7f0
  [cs]=f872f46795d01d073decbb551897f14553c3a027791ed7bc2c4d4b473309a05b
  [pt]=30ff61437317498276a0d107666321a267cbd54b295e4dda688697eb0bd86e88
  [en]=9e576c17ad32a1efa1dd49818dcce0ded349f14ca504d6132cb2e127aa690382
  [pub]=bf11f89113745eac7182c84b6976f0677c7f8fce6585513a51d1509eb71c2948
  [man]=b9df671719a78c4c76b7aea9c8a39baba9ad8997f5428c928502bdb0e72cbc8c
)
MAN_PACKAGES="manpages-de manpages-es manpages-it manpages-ru manpages-pl manpages-cs manpages-pt-br"

inputs() { find $1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort; }
man_pages() { for p in $MAN_PACKAGES; do dpkg -L "$p" | grep '\.gz$' | LC_ALL=C sort; done; }

step "1/4 one silo per language, each curated on its own, and the public silo"
for l in "${LANGS[@]}" pub; do
  sha=$(inputs "${SOURCES[$l]}" | xargs cat | sha256sum | cut -d' ' -f1)
  if [ "$sha" != "${EXPECTED_SHA256[$l]}" ]; then
    echo "silo $l: inputs have sha256 $sha, expected ${EXPECTED_SHA256[$l]} (other package" \
      "versions: the results are not comparable with bench/README.md's)" >&2
    [ -n "${ALLOW_OTHER_INPUTS:-}" ] || exit 1
  fi
  paths=$(for p in ${SOURCES[$l]}; do printf '"%s", ' "$p"; done)
  sed -e "s|@LANG@|$l|g" -e "s|@OUT@|$OUT|g" -e "s|@PATHS@|${paths%, }|" "$HERE/silo.toml.in" \
    >"$OUT/configs/silo-$l.toml"
  if [ ! -f "$OUT/data/$l/curated-train.jsonl" ]; then
    "$POLLEN" data prepare --config "$OUT/configs/silo-$l.toml" --no-tokenize --threads "$THREADS" \
      >"$OUT/prepare-$l-text.log" 2>&1 || { cat "$OUT/prepare-$l-text.log"; exit 1; }
  fi
  printf '  %-3s %7d documents for training, %5d held out, %6.2f MB of input\n' "$l" \
    "$(wc -l <"$OUT/data/$l/curated-train.jsonl")" \
    "$(wc -l <"$OUT/data/$l/curated-validation.jsonl")" \
    "$(inputs "${SOURCES[$l]}" | xargs cat | wc -c | awk '{print $1 / 1e6}')"
done

if [ "$WARMUP_SILO" = man ]; then
  sha=$(man_pages | xargs cat | sha256sum | cut -d' ' -f1)
  [ "$sha" = "${EXPECTED_SHA256[man]}" ] || [ -n "${ALLOW_OTHER_INPUTS:-}" ] ||
    { echo "silo man: inputs have sha256 $sha, expected ${EXPECTED_SHA256[man]}" >&2; exit 1; }
  if [ ! -d "$OUT/man-text" ]; then
    man_pages | while read -r f; do
      d="$OUT/man-text.tmp/$(basename "$(dirname "$(dirname "$f")")")"
      mkdir -p "$d"
      zcat "$f" | groff -k -man -Tutf8 -P-cbou -rLL=300n 2>/dev/null | tr -s ' ' \
        >"$d/$(basename "$f" .gz).txt"
    done
    mv "$OUT/man-text.tmp" "$OUT/man-text"
  fi
  sed -e "s|@LANG@|man|g" -e "s|@OUT@|$OUT|g" -e "s|@PATHS@|\"$OUT/man-text\"|" \
    -e 's|format = "delimited"|format = "text"|' -e '/^delimiter/d' -e '/^exclude/d' \
    "$HERE/silo.toml.in" >"$OUT/configs/silo-man.toml"
  printf '  man %6.2f MB of rendered manual pages\n' \
    "$(cat "$OUT"/man-text/*/* | wc -c | awk '{print $1 / 1e6}')"
fi

step "2/4 the shared tokenizer from each silo's pre-token counts"
if [ ! -f "$OUT/tokenizer.json" ]; then
  for l in "${LANGS[@]}"; do
    "$POLLEN" tokenizer count --input "$OUT/data/$l/curated-train.jsonl" --jsonl --min-count 2 \
      --threads "$THREADS" --output "$OUT/counts/$l.counts" >/dev/null
  done
  "$POLLEN" tokenizer train --counts "$OUT"/counts/*.counts --vocab-size 2048 \
    --special '<|endoftext|>' --threads "$THREADS" --output "$OUT/tokenizer.json" >/dev/null
fi
FINGERPRINT=$("$POLLEN" tokenizer info --tokenizer "$OUT/tokenizer.json" |
  awk '/fingerprint/ {print $NF}')
PUBLIC=(pub)
[ "$WARMUP_SILO" = pub ] || PUBLIC+=("$WARMUP_SILO")
for l in "${LANGS[@]}" "${PUBLIC[@]}"; do
  if ! jq -e '.shards | length > 0' "$OUT/data/$l/manifest.json" >/dev/null 2>&1; then
    "$POLLEN" data prepare --config "$OUT/configs/silo-$l.toml" --threads "$THREADS" \
      >"$OUT/prepare-$l.log" 2>&1 || { cat "$OUT/prepare-$l.log"; exit 1; }
  fi
  jq -r --arg l "$l" '([.shards[] | select(.split == "train") | .num_tokens] | add) as $t |
    ([.shards[] | select(.split == "validation") | .num_tokens] | add) as $v |
    "  \($l): \($t) training tokens, \($v) held out"' "$OUT/data/$l/manifest.json"
done

# Where every run starts: the shared warm-up's checkpoint (empty: random weights from seed 0).
INIT=""
init_from() { [ -z "$INIT" ] || echo "init_from = \"$INIT\""; }

# The inner schedule of the clients (over their own steps); the baseline's is the same at its
# own peak rate.
train_table() {
  cat <<TOML
micro_batch = $MICRO_BATCH
seq = $SEQ
lr = $INNER_LR
min_lr = $MIN_LR
schedule = "cosine"
warmup_steps = $WARMUP
total_steps = $STEPS
weight_decay = 0.0
grad_clip = $GRAD_CLIP
beta1 = $INNER_BETA1
beta2 = $INNER_BETA2
eval_batches = 4
TOML
}

federated() {  # name n codec
  local name=$1 n=$2 codec=$3 ids="" manifests=""
  for l in "${LANGS[@]:0:n}"; do
    ids+="\"$l\", "
    manifests+="\"$OUT/data/$l/manifest.json\", "
  done
  cat >"$OUT/configs/$name.toml" <<TOML
[sim]
clients = [${ids%, }]
manifests = [${manifests%, }]
threads = $THREADS
[server]
dir = "$OUT/runs/$name"
seed = $SEED
rounds = $ROUNDS
local_steps = $H
eval_every = 1
[model]
file = "$MODEL"
$(init_from)
[tokenizer]
fingerprint = "$FINGERPRINT"
[strategy]
name = "$OUTER"
lr = $OUTER_LR
momentum = $OUTER_MOMENTUM
momentum_warmup_rounds = $MOMENTUM_WARMUP
beta1 = $OUTER_BETA1
beta2 = $OUTER_BETA2
tau = $OUTER_TAU
$([ "$ROW_WEIGHTING" = none ] || echo "row_weighting = \"$ROW_WEIGHTING\"")
$([ "$SECOND_MOMENTS" = none ] || echo "second_moments = \"$SECOND_MOMENTS\"")
$([ "$FIRST_MOMENTS" = none ] || echo "first_moments = \"$FIRST_MOMENTS\"")
embedding_lr_scale = $EMBEDDING_LR_SCALE
[compression]
codec = "$codec"
server_codec = "${SERVER_CODEC:-$codec}"
block = $BLOCK
scale = "$SCALE"
$([ "$codec" != topk ] && [ "${SERVER_CODEC:-$codec}" != topk ] || echo "topk = $TOPK")
[train]
$(train_table)
$([ "$ROUND_WARMUP" = 0 ] || echo "round_warmup_steps = $ROUND_WARMUP")
$([ "$DRIFT" = 0 ] || echo "drift_correction = $DRIFT")
$([ "$PROXIMAL_MU" = 0 ] || echo "proximal_mu = $PROXIMAL_MU")
TOML
  rm -rf "$OUT/runs/$name"
  "$POLLEN" fed simulate --config "$OUT/configs/$name.toml" >"$OUT/$name.log" 2>&1 ||
    { tail -20 "$OUT/$name.log"; exit 1; }
  grep -E "round [0-9]+ done" "$OUT/$name.log" | sed -e 's/^.*fed server: /  /'
  # pollen plot's records: cumulative tokens, train loss, validation loss of the global model.
  jq -c -s 'reduce (.[] | select(.status == "aggregated")) as $r ({t: 0, out: []};
      .out += [{tokens: .t, val_loss: $r.eval_loss}] | .t += $r.tokens |
      .out += [{tokens: .t, loss: $r.train_loss}]) | .out[] | select(.loss or .val_loss)' \
    "$OUT/runs/$name/metrics.jsonl" >"$OUT/runs/$name/curves.jsonl"
}

baseline() {  # name n lr
  local name=$1 n=$2 lr=$3 manifests="" weights=""
  for l in "${LANGS[@]:0:n}"; do
    manifests+="\"$OUT/data/$l/manifest.json\", "
    weights+="1.0, "
  done
  cat >"$OUT/configs/$name.toml" <<TOML
[run]
name = "$name"
dir = "$OUT/runs/$name"
seed = $SEED
threads = $THREADS
[model]
file = "$MODEL"
$(init_from)
[data]
manifests = [${manifests%, }]
weights = [${weights%, }]
validation_split = ""
[train]
steps = $STEPS
seq = $SEQ
micro_batch = $MICRO_BATCH
batch_tokens = $((n * MICRO_BATCH * SEQ))
grad_clip = $GRAD_CLIP
[optimizer]
lr = $lr
weight_decay = 0.0
[schedule]
kind = "cosine"
warmup_steps = $WARMUP
min_lr = $MIN_LR
[checkpoint]
interval = $STEPS
keep = 1
[metrics]
log_interval = 25
TOML
  rm -rf "$OUT/runs/$name"
  "$POLLEN" train --config "$OUT/configs/$name.toml" >"$OUT/$name.log" 2>&1 ||
    { tail -20 "$OUT/$name.log"; exit 1; }
  cp "$OUT/runs/$name/metrics.jsonl" "$OUT/runs/$name/curves.jsonl"
}

# The shared warm-up: pollen train on the public silo alone, global batch 4 x local batch.
warmup() {  # name
  local name=$1
  cat >"$OUT/configs/$name.toml" <<TOML
[run]
name = "$name"
dir = "$OUT/runs/$name"
seed = 0
threads = $THREADS
[model]
file = "$MODEL"
[data]
manifests = ["$OUT/data/$WARMUP_SILO/manifest.json"]
validation_split = ""
[train]
steps = $WARMUP_STEPS
seq = $SEQ
micro_batch = $MICRO_BATCH
batch_tokens = $((4 * MICRO_BATCH * SEQ))
grad_clip = 1.0
[optimizer]
lr = $WARMUP_LR
weight_decay = 0.0
[schedule]
kind = "cosine"
warmup_steps = $WARMUP
min_lr = $MIN_LR
[checkpoint]
interval = $WARMUP_STEPS
keep = 1
[metrics]
log_interval = 50
TOML
  rm -rf "$OUT/runs/$name"
  "$POLLEN" train --config "$OUT/configs/$name.toml" >"$OUT/$name.log" 2>&1 ||
    { tail -20 "$OUT/$name.log"; exit 1; }
}

evaluate() {  # name n [output name]
  local name=$1 n=$2 ms=()
  for l in "${LANGS[@]:0:n}"; do ms+=("$OUT/data/$l/manifest.json"); done
  local ckpt
  ckpt=$(find "$OUT/runs/$name/checkpoints" -maxdepth 1 -name 'step-*' | sort | tail -1)
  "$POLLEN" eval --model "$MODEL" --checkpoint "$ckpt" --data "${ms[@]}" \
    --seq "$SEQ" --threads "$THREADS" >"$OUT/eval/${3:-$name}.jsonl"
}

mean_loss() { jq -s '[.[].loss] | add / length' "$OUT/eval/$1.jsonl"; }

# The baseline at each rate of BASELINE_LRS; baseline-N becomes the best of them (its run folder
# a link to that run's, its evaluation a copy).
baseline_sweep() {  # n
  local n=$1 lr best="" best_mean=""
  rm -rf "$OUT/runs/baseline-$n"
  for lr in $BASELINE_LRS; do
    local t0 name=baseline-lr$lr-$n
    t0=$(date +%s)
    step "  $name"
    baseline "$name" "$n" "$lr"
    evaluate "$name" "$n"
    SECONDS_OF[$name]=$(($(date +%s) - t0))
    local m
    m=$(mean_loss "$name")
    if [ -z "$best" ] || awk -v a="$m" -v b="$best_mean" 'BEGIN {exit !(a < b)}'; then
      best=$name best_mean=$m
    fi
  done
  echo "  the baseline: $best (mean $best_mean)"
  ln -s "$best" "$OUT/runs/baseline-$n"
  cp "$OUT/eval/$best.jsonl" "$OUT/eval/baseline-$n.jsonl"
}

WARMUP_NAME=warmup-$WARMUP_STEPS-$WARMUP_LR
[ "$WARMUP_SILO" = pub ] || WARMUP_NAME+=-$WARMUP_SILO
# Another model warms up on its own (its name in the run folder).
[ "$MODEL" = "$(realpath $HERE/model.toml)" ] || WARMUP_NAME+=-$(basename "$MODEL" .toml)
if [ "$WARMUP_STEPS" -gt 0 ]; then
  step "2b/4 the shared warm-up: $WARMUP_STEPS steps on the public silo $WARMUP_SILO (lr $WARMUP_LR)"
  if ! ls -d "$OUT/runs/$WARMUP_NAME/checkpoints/step-"* >/dev/null 2>&1; then
    warmup "$WARMUP_NAME"
  fi
  INIT=$(find "$OUT/runs/$WARMUP_NAME/checkpoints" -maxdepth 1 -name 'step-*' | sort | tail -1)
  echo "  every run starts from $INIT"
fi

step "3/4 training: H=$H, $ROUNDS rounds, local batch $MICRO_BATCH x $SEQ, inner lr $INNER_LR"
declare -A SECONDS_OF
for n in $CLIENTS; do
  [ -z "$INIT" ] || evaluate "$WARMUP_NAME" "$n" "$WARMUP_NAME-$n"
  curves=()
  for run in $RUNS; do
    t0=$(date +%s)
    case $run in
      baseline) baseline_sweep "$n" ;;
      diloco | diloco-*)
        step "  $run-$n"
        federated "$run-$n" "$n" "$([ "$run" = diloco ] && echo none || echo "${run#diloco-}")"
        evaluate "$run-$n" "$n"
        SECONDS_OF[$run-$n]=$(($(date +%s) - t0))
        ;;
      *) echo "RUNS: unknown run '$run' (diloco, diloco-CODEC, baseline)" >&2; exit 1 ;;
    esac
    curves+=("$OUT/runs/$run-$n/curves.jsonl")
  done
  "$POLLEN" plot "${curves[@]}" --output "$OUT/curves-$n.svg" 2>/dev/null
done

step "4/4 results"
{
  echo "H=$H rounds=$ROUNDS steps=$STEPS local batch=${MICRO_BATCH}x$SEQ inner lr=$INNER_LR" \
    "baseline lrs=$BASELINE_LRS" \
    "(cosine to $MIN_LR, warmup $WARMUP) outer: $OUTER lr=$OUTER_LR momentum=$OUTER_MOMENTUM" \
    "momentum_warmup_rounds=$MOMENTUM_WARMUP" \
    "beta1=$OUTER_BETA1 beta2=$OUTER_BETA2 tau=$OUTER_TAU row_weighting=$ROW_WEIGHTING second_moments=$SECOND_MOMENTS" \
    "first_moments=$FIRST_MOMENTS embedding_lr_scale=$EMBEDDING_LR_SCALE" \
    "inner betas=$INNER_BETA1/$INNER_BETA2" \
    "block=$BLOCK scale=$SCALE seed=$SEED" \
    "start: $([ -n "$INIT" ] && echo "warm-up of $WARMUP_STEPS steps on $WARMUP_SILO (lr $WARMUP_LR)" ||
      echo "random weights")"
  echo
  echo "| run | clients | global batch (tokens) | steps | $(printf '%s | ' "${LANGS[@]}")mean | vs baseline | MB moved | less than baseline | seconds |"
  echo "|---|---|---|---|$(printf -- '---|%.0s' "${LANGS[@]}")---|---|---|---|---|"
  for n in $CLIENTS; do
    # every run's model has the same size (the warm-up's, or any other run's when RUNS has no
    # baseline)
    model_bytes=$(find -L "$OUT/runs" -path '*/checkpoints/*' -name model.safetensors | head -1 |
      xargs stat -c %s)
    # fp32 gradient = the parameters' bytes (the safetensors header is a few hundred bytes)
    dp_bytes=$(awk -v n="$n" -v s="$STEPS" -v m="$model_bytes" 'BEGIN {printf "%.0f", 2 * n * s * m}')
    base_mean=null  # "vs baseline" is left out when RUNS has no baseline
    [ ! -f "$OUT/eval/baseline-$n.jsonl" ] ||
      base_mean=$(mean_loss "baseline-$n")
    names=()
    [ -z "$INIT" ] || names+=("$WARMUP_NAME-$n")
    for run in $RUNS; do
      if [ "$run" = baseline ]; then
        for lr in $BASELINE_LRS; do names+=("baseline-lr$lr-$n"); done
      fi
      names+=("$run-$n")
    done
    for name in "${names[@]}"; do
      steps=$STEPS
      if [ "$name" = "$WARMUP_NAME-$n" ]; then  # where the runs start: 0 steps, nothing moved
        bytes=0 steps=0
      elif [ -f "$OUT/runs/$name/metrics.jsonl" ] && [ "${name#baseline}" = "$name" ]; then
        bytes=$(jq -s '[.[] | .bytes_sent + .bytes_received] | add' "$OUT/runs/$name/metrics.jsonl")
      else
        bytes=$dp_bytes
      fi
      losses=$(jq -r '.loss' "$OUT/eval/$name.jsonl" | awk '{printf "%.4f | ", $1}')
      pad=$(for ((i = n; i < ${#LANGS[@]}; i++)); do printf -- '- | '; done)
      jq -s -r --arg name "$name" --arg n "$n" --arg gb "$((n * MICRO_BATCH * SEQ))" \
        --arg steps "$steps" --arg losses "$losses$pad" --argjson base "$base_mean" \
        --argjson bytes "$bytes" --argjson dp "$dp_bytes" --arg s "${SECONDS_OF[$name]:-}" \
        '([.[].loss] | add / length) as $m |
        "| \($name) | \($n) | \($gb) | \($steps) | \($losses)\($m * 10000 | round / 10000) | \(if $base == null then "-" else "\(($m / $base - 1) * 1000 | round / 10)%" end) | \(if $bytes == 0 then "- | -" else "\($bytes / 1e6 * 10 | round / 10) | \($dp / $bytes * 10 | round / 10)x" end) | \($s) |"' \
        "$OUT/eval/$name.jsonl"
    done
  done
} | tee "$OUT/table.md"
echo
echo "done in $(($(date +%s) - START)) s; logs, runs and curves under $OUT/"
