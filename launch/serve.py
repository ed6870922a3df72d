"""Serve rollouts for a trainer in another process or on another slice.

    python launch/serve.py --config=configs/tiny.py --port=50051
    python launch/run.py --config=configs/tiny.py --config.rollout.mode=pipeline \\
        --config.rollout.server=127.0.0.1:50051 --workdir=/tmp/tiny_remote

Binds 127.0.0.1 unless --host names another interface (e.g. --host=0.0.0.0 on a pod's
generator slice); off loopback it refuses to start without a shared secret, which every RPC
must then carry: $RL_SCALING_ROLLOUT_TOKEN or --token_file (the trainer reads the same variable or
--config.rollout.token_file). Several replicas: one serve.py per engine slice, the trainer lists
them all in --config.rollout.servers=HOST:PORT,HOST:PORT,... With --weights_dir=DIR (gs:// too) the
replica polls the directory the trainer writes (--config.rollout.weights_dir=DIR) instead of
taking pushes. The server holds no weights until the trainer pushes them, or starts from
--params (an Orbax params checkpoint such as WORKDIR/warmstart/params, or a Hugging Face
directory); it serves the `rl_scaling.Rollout` gRPC service described in
rl_scaling/serving/server.py. With --jetstream it also serves JetStream's `Orchestrator`
API (Decode, HealthCheck; rl_scaling/serving/jetstream_service.py) over the same engine and
weights, for JetStream's stock clients:

    python launch/serve.py --config=configs/tiny.py --port=9000 --jetstream --params=runs/tiny/warmstart/params
    python -m rl_scaling.rollout.jetstream_compat JetStream/jetstream/tools/requester.py \\
        --server=127.0.0.1 --port=9000 --text="12+3=" --tokenizer=unused

One trainer at a time: the first trainer session to call holds the replica; another is refused
with FAILED_PRECONDITION naming the holder until the holder closes (a clean exit or preemption)
or has been silent for --session_lease_s. The port is bound exclusively: a second serve.py on a
taken --port exits with status 1 naming the address.

Ctrl-C or SIGTERM stops it cleanly; it exits with status 1 if its generator fails.
"""

import logging
import os
import signal
import sys
import threading


from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"),
    "Experiment config file (model, task and rollout sizes must match the trainer's).", lock_config=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind; 127.0.0.1 (loopback) unless set.")
_PORT = flags.DEFINE_integer("port", 50051, "Port to bind; 0 picks a free one (see --port_file).")
_PORT_FILE = flags.DEFINE_string("port_file", "", "If set, write the bound port here once serving.")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 0, "Local devices for the engine's mesh; 0 = all.")
_JETSTREAM = flags.DEFINE_bool("jetstream", False, "Also serve JetStream's Orchestrator API (Decode, HealthCheck).")
_TOKEN_FILE = flags.DEFINE_string("token_file", "", "File holding the shared secret (else $RL_SCALING_ROLLOUT_TOKEN).")
_WEIGHTS_DIR = flags.DEFINE_string("weights_dir", "", "Poll this directory (local or gs://) for the trainer's weights.")
_PARAMS = flags.DEFINE_string("params", "", "Start from these weights (Orbax params or a Hugging Face directory) "
                              "as version 0, instead of waiting for a trainer's push.")
_LEASE = flags.DEFINE_float("session_lease_s", 60.0, "A trainer session silent this long no longer holds the "
                            "replica (another trainer may then take it).")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import jax

    from rl_scaling import paths
    from rl_scaling.serving import rpc, wire
    from rl_scaling.serving import server as server_lib

    try:
        token = wire.load_token(_TOKEN_FILE.value)
    except ValueError as e:
        sys.exit(f"launch/serve.py: {e}")
    if not 0 <= _PORT.value <= 65535:
        sys.exit(f"launch/serve.py: --port={_PORT.value}: give 0..65535 (0 picks a free port)")
    if not token and not rpc.is_loopback(_HOST.value):
        sys.exit(f"launch/serve.py: --host={_HOST.value} does not resolve to loopback addresses only: set "
                 f"{wire.TOKEN_ENV} or --token_file (the shared secret every RPC must carry), or bind 127.0.0.1")
    paths.configure_storage(_CONFIG.value.get("storage"))
    if _PARAMS.value:  # before the engine is built: a wrong or unreachable path fails in seconds
        try:
            found = paths.exists(_PARAMS.value)
        except (paths.StorageError, paths.PathError) as e:
            sys.exit(f"launch/serve.py: --params={_PARAMS.value}: {e}")
        if not found:
            sys.exit(f"launch/serve.py: --params={_PARAMS.value} does not exist")
    devices = jax.devices()[: _NUM_DEVICES.value or None]
    try:
        srv = server_lib.serve(_CONFIG.value, host=_HOST.value, port=_PORT.value, devices=devices,
                               jetstream=_JETSTREAM.value, params=_PARAMS.value, token=token,
                               weights_dir=_WEIGHTS_DIR.value, session_lease_s=_LEASE.value)
    except paths.StorageError as e:
        sys.exit(f"launch/serve.py: --params={_PARAMS.value}: {e}")
    except OSError as e:  # a port in use or an address not on this host: named, not a grpc abort
        sys.exit(f"launch/serve.py: --host={_HOST.value} --port={_PORT.value}: {e}")
    stop = threading.Event()

    def on_signal(signum, frame):
        del frame
        logging.info("signal %d: stopping the rollout server", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if _PORT_FILE.value:
        tmp = _PORT_FILE.value + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(srv.port))
        os.replace(tmp, _PORT_FILE.value)
    services = "rl_scaling.Rollout" + (" and jetstream_proto.Orchestrator" if _JETSTREAM.value else "")
    print(f"rollout server ({services}) listening on {srv.address}", flush=True)
    error = ""
    while not stop.wait(0.5):
        error = srv.error()
        if error:
            logging.error("rollout generator failed; reporting it to clients for 5 s, then exiting:\n%s", error)
            stop.wait(5.0)
            break
    srv.stop()
    sys.exit(1 if error else 0)


if __name__ == "__main__":
    app.run(main)
