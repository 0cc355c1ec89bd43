"""vLLM's ``--kv-transfer-config`` / ``--ec-transfer-config`` JSON flags: which connector
and which role.  Both name one connector we speak (its transfer parameters' shape; the
bytes move over the workers' own transfer servers) and a role from a fixed set."""
from __future__ import annotations

import json
from typing import Optional


def parse_connector_config(text: Optional[str], kind: str, connector: str, roles: tuple[str, ...],
                           what_moves: str, default_role: Optional[str] = None) -> Optional[str]:
    """``text`` (the flag's JSON) -> its ``{kind}_role``, or None without a flag;
    ValueError naming the flag for a connector or role this worker does not serve.
    ``kind``: "kv" or "ec" (the flag is ``--{kind}-transfer-config``, its keys
    ``{kind}_connector`` / ``{kind}_role``)."""
    if not text:
        return None
    flag = f"--{kind}-transfer-config"
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    got, role = cfg.get(f"{kind}_connector"), cfg.get(f"{kind}_role", default_role)
    if got != connector:
        raise ValueError(f"{flag}: {kind}_connector {got!r} is not supported; {what_moves} move over the workers' own "
                         f"transfer servers in {connector}'s {kind}_transfer_params form "
                         f"(use \"{kind}_connector\": \"{connector}\")")
    if role not in roles:
        raise ValueError(f"{flag}: {kind}_role must be one of {', '.join(roles)}, got {role!r}")
    return role
