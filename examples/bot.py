"""The TASTE agent as a Pipecat bot file, run by Pipecat's development runner.

The usual Pipecat shape: ``bot(runner_args)`` builds a transport from what the runner hands it
(SmallWebRTC here; a telephony websocket or Daily the same way, given their parameters below) and
runs ``[transport.input(), TasteSpeechToSpeech(engine), transport.output()]``. The model is
loaded once, before the runner serves, and shared by every call; each call gets its own state.

    .venv/bin/python examples/bot.py                          # http://localhost:7860 (the runner's page)
    .venv/bin/python examples/bot.py --model DIR --device cuda
    .venv/bin/python examples/bot.py -t twilio -x YOUR.PROXY.HOST

Without ``--model`` it runs the embedded tiny random checkpoint (it babbles: a plumbing check).
The runner's browser page comes from ``pipecat-ai-prebuilt``, which pipecat-ai's ``runner`` extra
installs (``scripts/setup.sh`` does). With ``-t twilio`` the runner hangs up through Twilio's API
at the end of a call: set ``TWILIO_ACCOUNT_SID`` and ``TWILIO_AUTH_TOKEN`` (``taste-agent serve``'s
phone endpoint needs neither). ``taste-agent serve`` is the hardened server
(call limits, origin checks, its own page); this file is the form to start your own bot from.
"""

import argparse
import sys

from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.runner.types import RunnerArguments
from pipecat.runner.utils import create_transport
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams
from pipecat.workers.runner import WorkerRunner

from pipecat_taste import TasteEngine, TasteSpeechToSpeech, freeze_startup_objects

TRANSPORT_PARAMS = {
    "webrtc": lambda: TransportParams(audio_in_enabled=True, audio_out_enabled=True),
    "twilio": lambda: FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True),
    "telnyx": lambda: FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True),
    "plivo": lambda: FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True),
    "exotel": lambda: FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True),
}


async def bot(runner_args: RunnerArguments):
    engine = getattr(runner_args.cli_args, "engine", None)  # loaded once by main(), shared by the calls
    if engine is None:
        raise RuntimeError("the model is not loaded: start this file itself (python examples/bot.py)")
    transport = await create_transport(runner_args, TRANSPORT_PARAMS)
    pipeline = Pipeline([transport.input(), TasteSpeechToSpeech(engine), transport.output()])
    worker = PipelineWorker(pipeline, params=PipelineParams(enable_metrics=True),
                            idle_timeout_secs=runner_args.pipeline_idle_timeout_secs)

    @transport.event_handler("on_client_disconnected")
    async def _left(_transport, _client):
        await worker.cancel()

    runner = WorkerRunner(handle_sigint=runner_args.handle_sigint)
    await runner.add_workers(worker)
    await runner.run()


def main():
    from pipecat.runner.run import main as run

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded tiny one)")
    ours.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    args, _ = ours.parse_known_args()  # the runner parses its own options (and ours again) below
    picked = argparse.ArgumentParser(add_help=False)
    picked.add_argument("-t", "--transport", default=None)
    transport = picked.parse_known_args()[0].transport
    if transport is not None and transport not in TRANSPORT_PARAMS:  # (said now, not at the first call)
        sys.exit(f"examples/bot.py has no transport parameters for -t {transport}: add them to TRANSPORT_PARAMS "
                 f"(it has {', '.join(TRANSPORT_PARAMS)})")
    if "-h" not in sys.argv and "--help" not in sys.argv:  # the help needs no model
        try:
            engine = TasteEngine.from_pretrained(args.model, device=args.device)
        except (ValueError, OSError, RuntimeError) as e:  # a wrong path or device: its message says what to do
            sys.exit(f"cannot load the model: {e}")
        engine.warm_up()  # on CUDA: captures the graphs now, not during the first call
        freeze_startup_objects()  # full garbage collections then skip start-up's objects
        ours.set_defaults(engine=engine)  # reaches every bot() as runner_args.cli_args.engine
    run(argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[ours]))


if __name__ == "__main__":
    main()
