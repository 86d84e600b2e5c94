#!/usr/bin/env bash
# bench/gpu-peers.sh: fp4moe's gather and Mamba-2 scan next to the same-run peers (issue 12), in ONE call
# on the GPU machine: bench/gpu_gather_wg (production's up + down of one 30B-A3B MoE layer at 128 ..
# 8,192 tokens, tiled and checkpoint layouts) and bench/gpu_ssm (the prefill scan, 23 layers), then
# ../shared/anchors/moe_anchor.py (torch bf16 _grouped_mm on bf16 experts, the copy rate) and
# layer_anchor.py (the state-spaces/mamba Triton SSD scan, torch SDPA); bench/gpu_moe_decode (the decode MoE pair) and
# fp4moe bench at 512 + 128 / 2,048 + 32 tokens (speeds; --profile: the Mamba-2 layers' device time), 8,192 and 32,768
# (beyond the targets), bench/torch_grouped_mm_long.py (the torch peer at 2k-32k tokens); then issue 12's
# targets table from all of it (bench/gpu_targets.py; the inputs stay in $OUT/peers); last the Mamba-2 peer
# (layer_anchor.py: its Triton compiles are the call's slowest part and no row of the table needs them).
# Usage: bench/gpu-peers.sh --prepare DIR MAMBA EINOPS   here: DIR gets the anchors, the two programs
#                                                        (stripped, xz; from build-gpum) and the Python
#                                                        packages mamba_ssm (ops/triton + utils only:
#                                                        no CUDA extension) and einops, copied from git
#                                                        checkouts MAMBA (state-spaces/mamba) and EINOPS
#                                                        (arogozhnikov/einops); carry DIR
#        bench/gpu-peers.sh DIR PKG                      on the GPU machine (PKG: a batch package for
#                                                        the libraries, scripts/gpu-staged-check.sh --package);
#                                                        PEERS_SKIP_LONG=1: without the 8,192 / 32,768-token
#                                                        prompts and the torch 2k-32k peer (beyond the targets)
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
    D=${2:?DIR}; M=${3:?MAMBA checkout}; EI=${4:?EINOPS checkout}
    mkdir -p "$D" && D=$(cd "$D" && pwd)
    mkdir -p "$D/bin" "$D/mamba_ssm/ops/triton" "$D/mamba_ssm/utils"
    cmake --build build-gpum --target gpu_ssm gpu_gather_wg gpu_moe_decode -j "$(nproc)" >/dev/null || exit 1
    for p in gpu_ssm gpu_gather_wg gpu_moe_decode; do strip -o "$D/bin/$p" "build-gpum/$p" && xz -f "$D/bin/$p" || exit 1; done
    cp ../shared/anchors/*.py "$D/" || exit 1
    cp "$M"/mamba_ssm/ops/triton/*.py "$D/mamba_ssm/ops/triton/" && cp "$M"/mamba_ssm/utils/*.py "$D/mamba_ssm/utils/" || exit 1
    : >"$D/mamba_ssm/__init__.py"; : >"$D/mamba_ssm/ops/__init__.py" # no CUDA extension imports
    (cd "$EI" && find einops -name '*.py' ! -path '*/tests/*' -exec cp --parents {} "$D/" \;) || exit 1
    echo "prepared $D"; exit 0
fi
D=${1:?usage: bench/gpu-peers.sh DIR PKG}
GP_NAME=batch
GP_BUILD=build-gpum
. scripts/gpu-pack.sh
gp_main "${2:?PKG}"
for p in gpu_ssm gpu_gather_wg gpu_moe_decode; do xz -dc "$D/bin/$p.xz" >"$GP_BIN/$p" && chmod +x "$GP_BIN/$p"; done
R=$(mkdir -p "${OUT:-/tmp}/peers" && cd "${OUT:-/tmp}/peers" && pwd) # what bench/gpu_targets.py reads
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "== fp4moe gather_qmm up + down (production column)"; timeout 120 "$GP_BIN/gpu_gather_wg" | grep '^|' | tee "$R/gather.txt"
echo "== fp4moe decode MoE pair (6 rows, graph)"; timeout 60 "$GP_BIN/gpu_moe_decode" 8 6 0 | tee "$R/decode.txt"
echo "== fp4moe Mamba-2 prefill scan"; timeout 120 "$GP_BIN/gpu_ssm" | tail -10
SYN="--synthetic nemotron-3-nano-30b-a3b --device cuda --json"
for P in 512 2048; do
    G=$([ $P = 512 ] && echo 128 || echo 32)
    timeout 150 "$GP_BIN/fp4moe" bench $SYN --prompt-tokens $P --gen-tokens $G --repeats 3 >"$R/e2e_$P.json" 2>"$R/e2e_$P.log"
    timeout 150 "$GP_BIN/fp4moe" bench $SYN --prompt-tokens $P --gen-tokens 1 --repeats 3 --profile >"$R/prof_$P.json" 2>"$R/prof_$P.log"
done
if [ "${PEERS_SKIP_LONG:-0}" != 1 ]; then # PEERS_SKIP_LONG=1: the targets only (a shorter call)
    for P in 8192 32768; do # beyond the targets: long prompts at the CLI's default chunk
        timeout 150 "$GP_BIN/fp4moe" bench $SYN --prompt-tokens $P --gen-tokens 8 --repeats 2 >"$R/e2e_$P.json" 2>"$R/e2e_$P.log"
    done
    echo "== torch bf16 _grouped_mm, 2k-32k tokens"
    timeout 150 python3 bench/torch_grouped_mm_long.py 2>"$R/torch_long.log" | tee "$R/torch_long.json" | tail -4
fi
T=$PWD
cd "$D" || exit 1
echo "== torch bf16 _grouped_mm"; timeout 150 python3 moe_anchor.py 2>"$R/torch.log" | tee "$R/torch.json" | tail -12
echo "== issue 12 targets"; python3 "$T/bench/gpu_targets.py" "$R" # before the slowest peer (Triton compiles)
echo "== mamba_ssm SSD, torch SDPA"; timeout 240 python3 layer_anchor.py . 2>&1 | tail -24
