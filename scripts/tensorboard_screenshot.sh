#!/usr/bin/env bash
# Retake docs/tensorboard.png, the README's picture of TensorBoard: a short real 2-process run (the quickstart with
# configs/trainer/ddp_cpu.yaml, 2 CPU processes over gloo), TensorBoard on its logs, and a headless Chromium's
# screenshot of the CUSTOM SCALARS tab, whose "every rank" charts draw one line per rank.
#
#   scripts/tensorboard_screenshot.sh                    # in Cohort's environment, from any folder
#   STEPS=300 OUTPUT=/tmp/tensorboard.png scripts/tensorboard_screenshot.sh
#
# Needs: Cohort installed (python -m app) with tensorboard, curl, and Chromium (Debian: apt-get install chromium).
# Takes about a minute on 2 idle CPU cores, nearly all of it the run. The run's logs and checkpoints go to a temporary
# folder, removed at the end; the embedded corpus is built in data/ if it is not there yet, as any run does.
#
# STEPS     optimizer steps of the run (150: 15 points per chart, one every trainer.log_every_n_steps = 10)
# PORT      TensorBoard's port on localhost (6199)
# OUTPUT    where the picture goes, relative to the repository root (docs/tensorboard.png)
# PYTHON    the Python of Cohort's environment (python)
# CHROMIUM  the browser (chromium)
set -euo pipefail

cd "$(dirname "$0")/.."
steps=${STEPS:-150}
port=${PORT:-6199}
output=${OUTPUT:-docs/tensorboard.png}
python=$(command -v "${PYTHON:-python}") || { echo "no ${PYTHON:-python}: set PYTHON to Cohort's Python" >&2; exit 1; }
chromium=${CHROMIUM:-chromium}
url="http://localhost:$port"

command -v "$chromium" >/dev/null || { echo "no $chromium: apt-get install chromium, or set CHROMIUM" >&2; exit 1; }
if curl -s -o /dev/null "$url"; then
  echo "port $port already answers (another TensorBoard?): set PORT to a free one" >&2
  exit 1
fi

work=$(mktemp -d)
tensorboard_pid=
cleanup() {
  if [[ -n "$tensorboard_pid" ]]; then
    kill "$tensorboard_pid" 2>/dev/null || true
    wait "$tensorboard_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

"$python" -m app fit -c configs/quickstart.yaml -c configs/trainer/ddp_cpu.yaml --trainer.max_steps "$steps" \
  --trainer.logger.init_args.save_dir "$work/logs"

# from the temporary folder, so that the sidebar reads "logs" rather than its random name
(cd "$work" && exec "$python" -m tensorboard.main --logdir logs --port "$port" >tensorboard.log 2>&1) &
tensorboard_pid=$!
# TensorBoard answers before it has read the event files; the layout appears once it has
for _ in $(seq 120); do
  if curl -s "$url/data/plugin/custom_scalars/layout" | grep -q '"every rank"'; then break; fi
  kill -0 "$tensorboard_pid" 2>/dev/null || { cat "$work/tensorboard.log" >&2; exit 1; }
  sleep 0.5
done
curl -s "$url/data/plugin/custom_scalars/layout" | grep -q '"every rank"' \
  || { echo "TensorBoard shows no custom-scalars layout after 60 s:" >&2; cat "$work/tensorboard.log" >&2; exit 1; }

# A fresh profile, so that settings a browser remembers for TensorBoard (in its local storage) don't change the
# picture; _smoothingWeight=0 draws the points as logged; the virtual-time budget lets the page fetch and draw every
# chart before the shot, however long that takes in real time. --no-sandbox: Chromium refuses root otherwise.
mkdir -p "$(dirname "$output")"
"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$work/chromium" \
  --window-size=1060,1000 --virtual-time-budget=20000 --screenshot="$work/tensorboard.png" \
  "$url/#custom_scalars&_smoothingWeight=0" >"$work/chromium.log" 2>&1 \
  || { cat "$work/chromium.log" >&2; exit 1; }
[[ -s "$work/tensorboard.png" ]] || { echo "Chromium wrote no picture:" >&2; cat "$work/chromium.log" >&2; exit 1; }
mv "$work/tensorboard.png" "$output"
echo "wrote $output ($(du -k "$output" | cut -f1) KiB) of $steps steps on 2 CPU processes"
