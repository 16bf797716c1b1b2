"""The OpenTelemetry Resource of this rank: the attributes that name its metric series.

Service, run id, rank (and role), local rank, world size, node and host, the rank's GPU (UUID, PCI
bus id: they join DCGM series to ranks) and the user's resource attributes, secret-looking ones
left out. No per-process attribute: per-launch attributes go on spans and logs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from otel_train import semconv
from otel_train.config import Config
from otel_train.distributed import Identity
from otel_train.redaction import is_secret_key

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.sdk.resources import Resource


def build_resource(config: Config, ident: Identity, gpu_attributes: Mapping[str, str]) -> Resource:
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {
        k: v
        for k, v in config.resource_attributes.items()
        if not is_secret_key(k)  # a secret-looking resource attribute would reach every exporter
    }
    attributes.update(gpu_attributes)
    attributes.update(
        {
            "service.name": config.service_name,
            "service.instance.id": ident.instance_id,
            semconv.RUN_ID: ident.run_id,
            semconv.RANK: ident.rank,
            **role_attribute(ident),
            "local_rank": ident.local_rank,
            "world_size": ident.world_size,
            "node_rank": ident.node_rank,
            "host.name": ident.host,
        }
    )
    # Resource.create() merges OTEL_RESOURCE_ATTRIBUTES (and the SDK defaults and detectors)
    # back in, so the filters run on what it returns, not only on what went in. No per-process
    # attribute stays (semconv.PROCESS_ATTRIBUTE_PREFIX): this Resource labels metric series;
    # per-launch attributes go on spans and logs only (build_telemetry's event_attributes).
    created = Resource.create(attributes)
    kept = {
        k: v
        for k, v in created.attributes.items()
        if not is_secret_key(k) and not k.startswith(semconv.PROCESS_ATTRIBUTE_PREFIX)
    }
    return Resource(kept, created.schema_url)


def role_attribute(ident: Identity) -> dict[str, str]:
    """The role resource/event attribute: none without a role (the identity is run id and rank alone)."""
    return {semconv.ROLE: ident.role} if ident.role else {}
