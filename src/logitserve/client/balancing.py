"""Load balancing over the servers a target names: the channel's service config, and the rule
that regions and sequences belong to one server.

A target may name several servers: gRPC's address list (``ipv4:10.0.0.1:50051,10.0.0.2:50051``,
``ipv6:[::1]:50051,[::1]:50052``) or a name that resolves to several addresses
(``dns:///logitserve.internal:50051``). The client's ``load_balancing`` picks gRPC's policy over them:

- ``"pick_first"`` (the default, gRPC's own): one connection, to the first address that answers;
  every call goes there. When that server goes away the channel reconnects, to the next address
  that answers. One server at a time is what regions and sequences need.
- ``"round_robin"``: a connection to every address; each call goes to the next ready one, so
  stateless calls (tensors sent as bytes in the request) spread over the servers. A server that
  stops leaves the rotation: its calls in flight fail UNAVAILABLE and the client's retries
  (``retries``, UNAVAILABLE only) send them again, to a server still ready. A ``dns:///`` name is
  resolved again when a connection is lost, not on a timer: servers added to the name join
  when a connection fails or the channel is new (gRPC's ``grpc.dns_min_time_between_resolutions_ms``
  bounds how often).

Regions and sequences are state one server holds: a region registered through a round_robin
client would be on one server while the calls naming it go to all of them. So a round_robin
client refuses the methods that register, look up or drop regions and open, update or close
sequences (ValueError naming ``load_balancing``); use a pick_first client of each server for those,
``Client(f"{host}:{port}")``, with round_robin's client beside them for the stateless calls.
"""

from __future__ import annotations

import json

POLICIES = ("pick_first", "round_robin")
# Channel options that set the policy another way: the service config's policy wins over
# grpc.lb_policy_name, so either would be ignored or would contradict ``load_balancing``.
POLICY_OPTIONS = ("grpc.lb_policy_name",)
POLICY_KEYS = ("loadBalancingConfig", "loadBalancingPolicy")


def policy(load_balancing: str) -> str:
    """``load_balancing``, checked: one of :data:`POLICIES`."""
    if load_balancing not in POLICIES:
        raise ValueError(f"load_balancing: must be one of {', '.join(POLICIES)}, got {load_balancing!r}")
    return load_balancing


def service_config(load_balancing: str, options: dict) -> str:
    """The channel's ``grpc.service_config`` (JSON): the one given in ``options`` (a method
    config, say), if any, with the load-balancing policy ``load_balancing``. The policy is set
    only through ``load_balancing``: ``options`` that set it too are refused."""
    for name in POLICY_OPTIONS:
        if name in options:
            raise ValueError(f"options: {name}: set the policy with load_balancing=, not a channel option")
    given = options.get("grpc.service_config")
    try:
        config = json.loads(given) if given else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"options: grpc.service_config: must be JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"options: grpc.service_config: must be a JSON object, got {type(config).__name__}")
    for key in POLICY_KEYS:
        if key in config:
            raise ValueError(f"options: grpc.service_config: {key}: set the policy with load_balancing=, "
                             f"not in the service config")
    config = {**config, "loadBalancingConfig": [{policy(load_balancing): {}}]}
    if load_balancing == "round_robin" and "healthCheckConfig" not in config:
        # Follow each server's health (grpc.health.v1 Watch): a draining server reports
        # NOT_SERVING and leaves the rotation before it turns calls away (tests/test_deploy_drain.py:
        # 19-48 calls turned away and retried without it, 0-1 with it).
        config["healthCheckConfig"] = {"serviceName": ""}
    return json.dumps(config)


def require_one_server(client, method: str) -> None:
    """Refuse ``method`` (state one server holds: regions, sequences) on a client whose calls
    spread over several servers."""
    if client.load_balancing != "pick_first":
        raise ValueError(
            f"{method}: regions and sequences belong to one server, and this client spreads its calls over the "
            f"target's addresses (load_balancing={client.load_balancing!r}); call it on a "
            f"load_balancing='pick_first' client of one server: Client(f\"{{host}}:{{port}}\")")
