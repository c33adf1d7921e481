# Sourced by scripts/launch_vllm.sh and scripts/launch_sglang.sh: sets HOST, the address the server listens on, to
# $FLUX_HOST (default 127.0.0.1) and exits 2 when that is not a loopback address and TORCHTITAN_FLUX_TOKEN (the
# shared token) is unset or empty: see "Security" in the README.
HOST=${FLUX_HOST:-127.0.0.1}
case "$HOST" in
  127.*|::1|localhost) ;;
  *) if [ -z "${TORCHTITAN_FLUX_TOKEN:-}" ]; then
       echo "FLUX_HOST=$HOST is not a loopback address: set TORCHTITAN_FLUX_TOKEN to the shared token first" >&2
       exit 2
     fi ;;
esac
