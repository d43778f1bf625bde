#!/usr/bin/env bash
# Pack verl 0.9.1 and what its PPO trainer needs that the GPU image lacks (Ray, hydra,
# datasets, TransferQueue, ...) for a GPU machine that cannot download anything, together with
# vLLM 0.24.0 (the shared recipe's parts), as one bundle split into parts carried one per
# device call.
#
# Usage (project root, a machine that reaches PyPI; no GPU):
#   bash ../shared/tools/prepare_gpu_vllm.sh .gpu          # vLLM 0.24.0 parts (GPU_VLLM.md)
#   bash scripts/gpu/prepare_verl.sh .gpu [--part-mib N]   # verl, then the bundle
#
# Writes OUTDIR/verl-call-1 .. verl-call-K: one part each plus install.sh (small), and
# OUTDIR/tok.tar.xz (the model's tokenizer; carried with the last part). On the GPU
# machine, back to back (the machine goes back about 30 s after a command ends):
#   bash .gpu/verl-call-K/install.sh            # K = 1 .. the last; each call carries its folder
#   source /tmp/verl-gpu/env.sh                 # after the last one
#
# The vLLM site goes first on PYTHONPATH (the image has none of it). verl's needs go in a
# .pth file appended to the image's site-packages, so that what the image already has
# (numpy, torch, transformers, accelerate, protobuf, requests, ...) wins and only the gaps
# are filled: carrying a package the image has is harmless.
#
# Part size: a call carries the working tree too (about 5 MiB here) and at most 64 MiB in all.
set -euo pipefail

OUT=""
PART_MIB=56
while [ $# -gt 0 ]; do
  case "$1" in
    --part-mib) PART_MIB=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "usage: $0 OUTDIR [--part-mib N]" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

PLAT=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
         manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 linux; do
  PLAT+=(--platform "${p}_x86_64")
done
PYTAGS=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLAT[@]}")

# verl 0.9.1's trainer path (main_ppo, FSDP workers, agent loops, RLHFDataset) and the
# versions tests use locally (scripts/install_verl.sh); TransferQueue for the V1 trainer (the
# default, trainer.use_v1); orjson (verl.utils.tracking imports it; the first GPU run stopped
# there). Not carried: what the GPU image already has (its package list in
# the device notes, checked there with pip list: pandas, pyarrow, peft, grpcio, msgpack,
# click, cloudpickle, fsspec, xxhash, protobuf, psutil, ...; under the .pth they would lose to
# the image's copies anyway), what vLLM's parts carry (dill, pyzmq, msgspec, fastapi,
# uvicorn), wandb (a logger we do not use) and Ray's dashboard extras.
cat > "$WORK/deps.txt" <<'DEPS'
verl==0.9.1
tensordict==0.10.0
pyvers==0.1.0
ray==2.60.0
omegaconf==2.3.1
hydra-core==1.3.8
codetiming==1.4.0
datasets==5.2.0
multiprocess==0.70.19
torchdata==0.11.0
TransferQueue==0.1.11
orjson==3.13.0
DEPS
# Published as source only: built here (pure Python).
SDISTS=(antlr4-python3-runtime==4.9.3 pylatexenc==2.11)

# verl's packed site is cached in OUTDIR/verl-cache (keyed by the pins), so running this again
# after the vLLM parts are ready only bundles.
KEY=$( (cat "$WORK/deps.txt"; echo "${SDISTS[@]}"; sed -n '/^# Never loaded/,/^du -sh/p' "$0") \
  | sha256sum | cut -c1-16)
CACHE="$OUT/verl-cache/verl-$KEY.tar.xz"
if [ ! -f "$CACHE" ]; then
echo "== verl wheels (Python 3.12, x86-64)"
python3 -m pip download -q --no-deps "${PYTAGS[@]}" -d "$WORK/whl" -r "$WORK/deps.txt"
python3 -m pip wheel -q --no-deps -w "$WORK/whl" "${SDISTS[@]}"
SITE="$WORK/site"
python3 -m pip install -q --no-deps --no-compile --no-index --target "$SITE" "${PYTAGS[@]}" \
  "$WORK"/whl/*.whl
rm -rf "$SITE/bin"
find "$SITE" -path '*.dist-info/direct_url.json' -delete
sed -i '/\.dist-info\/direct_url\.json,/d' "$SITE"/*.dist-info/RECORD
# Never loaded by a one-node PPO run (sizes unpacked):
rm -rf "$SITE/ray/jars"                              # 33 MB, Ray's Java workers
rm -rf "$SITE/ray/dashboard/client/build"            # 10 MB, the dashboard's web page
rm -rf "$SITE/ray/rllib"                             # 8 MB
du -sh "$SITE"

echo "== pack verl (xz)"
mkdir -p "$OUT/verl-cache"
tar -C "$SITE" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . \
  | xz -6 -T2 > "$CACHE.tmp"
mv "$CACHE.tmp" "$CACHE"
fi
cp "$CACHE" "$WORK/verl.tar.xz"
ls "$OUT"/call-*/payload.tar.xz.part-* >/dev/null 2>&1 || {
  echo "verl packed ($CACHE); no vLLM parts in $OUT yet: run prepare_gpu_vllm.sh $OUT, then this again" >&2
  exit 2; }
cat "$OUT"/call-*/payload.tar.xz.part-* > "$WORK/vllm.tar.xz"
(cd "$OUT/call-1" && grep ' payload.tar.xz$' SHA256SUMS) | sed "s#payload.tar.xz#$WORK/vllm.tar.xz#" \
  | sha256sum -c --quiet
# One bundle (vLLM's payload, then verl's), split in parts; install.sh cuts it back by size.
cat "$WORK/vllm.tar.xz" "$WORK/verl.tar.xz" > "$WORK/bundle"
(cd "$WORK" && split -b "${PART_MIB}M" -d -a 2 bundle bundle.part-)
PARTS=("$WORK"/bundle.part-*)
{
  echo "vllm.tar.xz $(stat -c %s "$WORK/vllm.tar.xz")"
  echo "verl.tar.xz $(stat -c %s "$WORK/verl.tar.xz")"
} > "$WORK/SIZES"
(cd "$WORK" && sha256sum bundle.part-* vllm.tar.xz verl.tar.xz) > "$WORK/SHA256SUMS"
cp "$WORK/deps.txt" "$WORK/verl-deps.txt"

cat > "$WORK/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Every call: stash this folder's part; once all are there, check them, unpack vLLM into
# $ROOT/site (first on PYTHONPATH) and verl's needs into $ROOT/verl-site (a .pth after the
# image's site-packages), and write $ROOT/env.sh. Idempotent.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${VERL_GPU_ROOT:-/tmp/verl-gpu}
mkdir -p "$ROOT/parts"
cp -f "$HERE"/bundle.part-* "$ROOT/parts/"
cp -f "$HERE"/SHA256SUMS "$HERE"/SIZES "$ROOT/"
need=$(grep -c 'bundle.part-' "$ROOT/SHA256SUMS")
have=$(ls "$ROOT/parts" | wc -l)
echo "verl-gpu: $have of $need parts in $ROOT/parts"
[ "$have" -ge "$need" ] || exit 0
[ -f "$ROOT/.unpacked" ] && { echo "verl-gpu: already unpacked"; exit 0; }
start=$(date +%s)
(cd "$ROOT/parts" && grep 'bundle.part-' "$ROOT/SHA256SUMS" | sha256sum -c --quiet)
vllm_size=$(awk '$1=="vllm.tar.xz"{print $2}' "$ROOT/SIZES")
cat "$ROOT"/parts/bundle.part-* > "$ROOT/bundle"
head -c "$vllm_size" "$ROOT/bundle" > "$ROOT/vllm.tar.xz"
tail -c +"$((vllm_size + 1))" "$ROOT/bundle" > "$ROOT/verl.tar.xz"
rm -f "$ROOT/bundle" "$ROOT"/parts/bundle.part-*
(cd "$ROOT" && grep -E ' (vllm|verl).tar.xz$' SHA256SUMS | sha256sum -c --quiet)
rm -rf "$ROOT/site" "$ROOT/verl-site" && mkdir -p "$ROOT/site" "$ROOT/verl-site"
xz -dc -T0 "$ROOT/vllm.tar.xz" | tar -C "$ROOT/site" -xf -
xz -dc -T0 "$ROOT/verl.tar.xz" | tar -C "$ROOT/verl-site" -xf -
rm -f "$ROOT/vllm.tar.xz" "$ROOT/verl.tar.xz"
# After the image's own packages: fills gaps only, and reaches Ray's worker processes too.
purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/verl-site" > "$purelib/zz_verl_gpu.pth"
cat > "$ROOT/env.sh" <<ENV
export PYTHONPATH=$ROOT/site\${PYTHONPATH:+:\$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
ENV
touch "$ROOT/.unpacked"
echo "verl-gpu: unpacked in $(( $(date +%s) - start )) s; now: source $ROOT/env.sh"
INSTALL
chmod +x "$WORK/install.sh"

rm -rf "$OUT"/verl-call-*
i=1
for part in "${PARTS[@]}"; do
  mkdir -p "$OUT/verl-call-$i"
  mv "$part" "$OUT/verl-call-$i/"
  cp "$WORK/install.sh" "$WORK/SHA256SUMS" "$WORK/SIZES" "$WORK/verl-deps.txt" \
     "$OUT/verl-call-$i/"
  i=$((i + 1))
done
# The model's tokenizer (the Qwen2.5 family's real vocabulary, built locally by
# pipeline.families; the weights are made on the GPU machine: 1 GB would not travel).
PY=${PYTHON:-.venv/bin/python}
rm -rf "$WORK/tok"
"$PY" -c "import sys; from pipeline.families import family_tokenizer
family_tokenizer('qwen2.5').save_pretrained(sys.argv[1])" "$WORK/tok"
tar -C "$WORK/tok" -cJf "$OUT/tok.tar.xz" .
du -sh "$OUT"/verl-call-* "$OUT/tok.tar.xz"
echo "done: carry $OUT/verl-call-1 .. verl-call-$((i - 1)), one per device call"
