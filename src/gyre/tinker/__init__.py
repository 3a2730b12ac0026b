"""A Tinker-API server over gyre: the official ``tinker`` SDK trains and samples locally.

``gyre tinker-serve`` (:mod:`gyre.tinker.server`) answers the SDK's ``/api/v1`` routes;
:mod:`service` holds sessions, models and futures; :mod:`tenants` the LoRA adapters on one base
model; :mod:`losses` maps each ``loss_fn`` onto gyre's loss terms; :mod:`compute` does the
forward/backward, optimizer step and sampling; :mod:`store` the atomic checkpoints;
:mod:`wire` the SDK's protobuf payloads. User guide: docs/tinker.md.
"""
