"""The generation deployment on a model slowed on purpose (every step sleeps ``STEP_S``), two
slots: priorities, deadlines and ``n`` show in steps of a known length, whatever the load."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ember
from ember.deployments._textgen_engine import EngineConfig
from ember.deployments.textgen import MODEL_NAME, Generator, load_backend
from ember.protocols import GenerateRequest, OpenAIGeneration

from slowgen import SlowBackend

STEP_S = 0.05
#: No aging within a test's span: the order is the priorities' alone.
LIMITS = EngineConfig(max_num_seqs=2, max_waiting_seqs=4, priority_aging_s=600,
                      name="AdmitGen")


@ember.deployment(name="AdmitGen", warm_floor=0, max_replicas=1, num_cpus=0.25,
                  max_ongoing_requests=16, target_queue_depth=8, scaledown_after_s=600,
                  request_timeout_s=120)
class AdmitGen:
    def setup(self) -> None:
        self.backend = SlowBackend(load_backend(), STEP_S)
        self.generator = Generator(self.backend, LIMITS)

    @ember.route("/generate")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk

    @ember.route("/admitgen/stats", method="GET")
    def stats(self) -> dict[str, Any]:
        """What the engine holds now, and every prompt prefilled so far (as text)."""
        engine = self.generator.engine
        return {"running": engine.running, "waiting": engine.waiting,
                "slots_used": engine.slots_used,
                "prefilled": [bytes(t for t in p if t < 256).decode(errors="replace")
                              for p in self.backend.prefills]}


app = ember.App([AdmitGen], name="textgen-admission", protocols=[
    OpenAIGeneration(deployment="AdmitGen", attr="generate", model=MODEL_NAME)])
