#!/usr/bin/env bash
# Exit soak: N 2-rank runs in a row under a CPU burner, each must exit 0 on every rank with no
# "terminate called" line (issue 17 item 8: a worker aborting on its way out of a finished run).
#   bash tools/exit_soak.sh finished N   # torchrun --nproc-per-node 2, a finished local-SGD run
#   bash tools/exit_soak.sh restart N    # torchrun --max-restarts 2, the last rank crashing twice
#                                        #   (IST_TEST_FAIL_AT_ROUND=1,3, as test_launcher does)
#   bash tools/exit_soak.sh netns N      # (root) each rank in a network namespace of its own,
#                                        #   joined by a bridge, the torchrun environment by hand,
#                                        #   GLOO_SOCKET_IFNAME set: the demo's --quick config
# Bounded: N runs, each under a 300 s timeout. The burner, the namespaces and their links are
# removed on every exit path (trap). Prints one line per failure and "runs N failures F"; exits 1
# on any failure.
set -u
MODE=${1:?finished, restart or netns}
N=${2:-100}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=$(mktemp -d)
BURNER=
cleanup() {
  [ -n "$BURNER" ] && kill "$BURNER" 2>/dev/null
  if [ "$MODE" = netns ]; then for n in istA istB istBR; do ip netns del $n 2>/dev/null; done; fi
  rm -rf "$LOGS"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$PY" -c 'while True: pass' & BURNER=$!
TINY=(--dataset digits --model mlp --width 16 --local-steps 2 --batch-size 8 --no-progress --no-plots
      --threads 1 --device cpu)
if [ "$MODE" = netns ]; then
  ip netns add istA && ip netns add istB && ip netns add istBR || { echo "exit_soak: netns needs root (CAP_NET_ADMIN)"; exit 2; }
  ip netns exec istBR ip link add br0 type bridge
  ip netns exec istBR ip link set br0 up
  for n in A B; do
    ip link add veth$n type veth peer name br$n
    ip link set veth$n netns ist$n
    ip link set br$n netns istBR
    ip netns exec istBR ip link set br$n master br0
    ip netns exec istBR ip link set br$n up
    ip netns exec ist$n ip link set lo up
    ip netns exec ist$n ip link set veth$n up
  done
  ip netns exec istA ip addr add 10.77.0.1/24 dev vethA
  ip netns exec istB ip addr add 10.77.0.2/24 dev vethB
fi
fails=0
for i in $(seq 1 "$N"); do
  out="$LOGS/out"; rm -rf "$out"; log="$LOGS/run_$i"
  case "$MODE" in
    finished)
      timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m ist_kernels.train \
        --method localsgd --rounds 2 "${TINY[@]}" --out-dir "$out" > "$log.txt" 2>&1; rc=$? ;;
    restart)
      IST_TEST_FAIL_AT_ROUND=1,3 timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        --max-restarts 2 -m ist_kernels.train --method localsgd --rounds 4 --checkpoint-interval 2 \
        --eval-interval 2 "${TINY[@]}" --out-dir "$out" > "$log.txt" 2>&1; rc=$? ;;
    netns)
      port=$((29700 + i % 200))
      for r in 0 1; do
        n=$([ $r = 0 ] && echo A || echo B)
        ip netns exec ist$n env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=10.77.0.1 MASTER_PORT=$port \
          GLOO_SOCKET_IFNAME=veth$n timeout 300 "$PY" -m ist_kernels.train --demo --quick --no-progress \
          --no-plots --threads 1 --device cpu --out-dir "$out" > "${log}_$r.txt" 2>&1 &
        eval "P$r=\$!"
      done
      wait "$P0"; r0=$?; wait "$P1"; r1=$?; rc=$((r0 | r1))
      cat "${log}"_*.txt > "$log.txt" ;;
    *) echo "exit_soak: unknown mode $MODE"; exit 2 ;;
  esac
  if [ "$rc" -ne 0 ] || grep -q "terminate called" "$log.txt"; then
    fails=$((fails + 1))
    echo "run $i: exit $rc; $(grep -m2 'terminate called\|error' "$log.txt" | tr '\n' ' ')"
  fi
done
echo "runs $N failures $fails"
[ "$fails" -eq 0 ]
