"""What every resource shares: settings, the broker client, the cluster cache, metrics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateway.cluster_info import ClusterInfoCache
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings


@dataclass
class GatewayState:
    settings: GatewaySettings
    client: object  # common.client.AsyncClient (or anything with its interface)
    cluster: ClusterInfoCache
    metrics: GatewayMetrics
    image: Optional[object] = None  # gateway.openai_api.model_files.ImageSpec: the model takes images
    # gateway.render_pool.RenderPool: tokenizing, template rendering and detokenizing run
    # there, off the event loop (created with the app; its threads start on first use).
    render_pool: Optional[object] = None
    trimmer: Optional[object] = None  # gateway.render_pool.MemoryTrimmer
    # gateway.structured_outputs.policy.StructuredOutputsPolicy: --structured-outputs-config,
    # the reasoning markers and the grammar-check cache (None: defaults, no markers).
    structured_outputs: Optional[object] = None
