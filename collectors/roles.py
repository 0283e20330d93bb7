"""Who is who and who may do what: the three roles (viewer reads, operator remediates and
approves, admin does everything), node agents, what each role may do, and how a caller is named
in the audit trail and the access log (``user:NAME``, ``token:NAME``, ``system``).

Low in the import graph on purpose: the apps' APIs and pages and the project's middleware all
ask it, and it asks nothing of them.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, Group, Permission, User
from django.http import HttpRequest

from collectors.push import AGENT_SOURCES, INGEST_SOURCES, PushRights

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
# A node agent: may push signals, for its own node only (its user is "agent:<node>").
AGENT = "agent"
AGENT_PREFIX = "agent:"
# Who acts when no person or token does (the beat, automatic remediation, a command).
SYSTEM = "system"

# What a call needs. A token also needs the matching scope (collectors/api/permissions.py).
READ, OPERATE, INGEST, ADMIN_ONLY = "read", "operate", "ingest", "admin"

if TYPE_CHECKING:
    from rest_framework.request import Request


def roles_ensure() -> None:
    operate = Permission.objects.get(codename="operate", content_type__app_label="incidents")
    Group.objects.get_or_create(name=VIEWER)
    operator, _ = Group.objects.get_or_create(name=OPERATOR)
    operator.permissions.add(operate)
    admin, _ = Group.objects.get_or_create(name=ADMIN)
    admin.permissions.add(operate)
    Group.objects.get_or_create(name=AGENT)


def agent_user(node: str) -> User:
    """The user a node agent's token belongs to; it has no password and no other role."""
    roles_ensure()
    user, _ = User.objects.get_or_create(username=f"{AGENT_PREFIX}{node}")
    user.set_unusable_password()
    user.save()
    user.groups.set([Group.objects.get(name=AGENT)])
    user.__dict__.pop("_fleetwatch_groups", None)
    return user


def _groups(user: User | AnonymousUser) -> frozenset[str]:
    """The user's group names, read once per user object (one request's): a push asks
    role_of and push_rights, and each read was a query on the hot path of every push."""
    cached: frozenset[str] | None = getattr(user, "_fleetwatch_groups", None)
    if cached is None:
        cached = frozenset(user.groups.values_list("name", flat=True))
        user._fleetwatch_groups = cached  # type: ignore[union-attr]
    return cached


def groups_known(user: AbstractBaseUser, names: Iterable[str]) -> None:
    """The user's group names, read with the user (API token authentication reads them in
    the token's statement): ``_groups`` then asks nothing."""
    user._fleetwatch_groups = frozenset(names)  # type: ignore[attr-defined]


def agent_node(user: User | AnonymousUser) -> str | None:
    """The node an agent user may push for; ``None`` for people."""
    if user.username.startswith(AGENT_PREFIX) and AGENT in _groups(user):
        return user.username[len(AGENT_PREFIX):]
    return None


def push_rights(user: User | AnonymousUser) -> PushRights:
    node = agent_node(user)
    if node is not None:
        return PushRights(f"the agent token of {node}", AGENT_SOURCES, node)
    return PushRights("an ingest token", INGEST_SOURCES)


def user_with_role(username: str, role: str, password: str | None = None) -> tuple[User, str]:
    """Create or update a user in one role. Returns the user and the password set."""
    roles_ensure()
    password = password or secrets.token_urlsafe(9)
    user, _ = User.objects.get_or_create(username=username)
    user.set_password(password)
    user.is_staff = user.is_superuser = role == ADMIN
    user.save()
    user.groups.set([Group.objects.get(name=role)])
    user.__dict__.pop("_fleetwatch_groups", None)
    return user, password


def role_of(user: User | AnonymousUser | None) -> str | None:
    """admin, operator, viewer, agent, or None (anonymous or no role)."""
    if user is None or not user.is_authenticated:
        return None
    if getattr(user, "is_superuser", False):
        return ADMIN
    groups = _groups(user)
    if ADMIN in groups:
        return ADMIN
    if OPERATOR in groups:
        return OPERATOR
    # An agent's user is made for its agent alone (agent_user) and holds no other role; asked
    # before the permission check, which costs two queries on every push.
    if agent_node(user) is not None:
        return AGENT
    if user.has_perm("incidents.operate"):
        return OPERATOR
    if VIEWER in groups:
        return VIEWER
    return None


def role_allows(role: str | None, need: str) -> bool:
    if role is None:
        return False
    if need == READ:
        return role in (VIEWER, OPERATOR, ADMIN)
    if need == OPERATE:
        return role in (OPERATOR, ADMIN)
    if need == INGEST:
        return role in (AGENT, OPERATOR, ADMIN)
    return role == ADMIN


def actor_name(user: AbstractBaseUser | AnonymousUser | None, *, token: bool = False) -> str:
    """``system`` for no one, ``user:NAME`` for a person, ``token:NAME`` for an API token
    (the token's owner, never the key)."""
    if user is None or not user.is_authenticated:
        return SYSTEM
    return f"{'token' if token else 'user'}:{user.get_username()}"


def actor_shown(actor: str) -> str:
    """An audit actor as a person reads it: "demo" for user:demo, "token ci" for token:ci,
    "system" for the system."""
    kind, _, name = actor.partition(":")
    if not name:
        return actor
    return name if kind == "user" else f"{kind} {name}"


def actor_from_request(request: HttpRequest | Request) -> str:
    """Who is acting in a request: ``token:NAME`` when an API token authenticated it (the
    token's name, never its key), else ``user:NAME`` for a signed-in person. DRF leaves the
    token in ``request.auth`` (on the DRF request and the Django request underneath); a
    session login leaves None there. Works for plain Django views too."""
    auth = getattr(request, "auth", None)
    name = getattr(auth, "name", None)
    if isinstance(name, str) and name:
        return f"token:{name}"
    return actor_name(getattr(request, "user", None), token=auth is not None)


# --- the demo login (`make run`) ---------------------------------------------------------------

DEMO_LOGIN_FILE = "demo-login.json"


def demo_login_ensure(username: str, saved_in: Path, *, password: str | None = None,
                      rotate: bool = False) -> tuple[str | None, str]:
    """The operator login `make run` prints, made once and kept across restarts.

    Returns the password to show (None when it cannot be known: someone changed it since) and
    what happened: "created", "set", "rotated" or "kept". A password FleetWatch set is saved
    in ``saved_in`` (the embedded default's data folder, readable by its owner alone) so that
    every start can print the whole login again; the saved copy is shown only while it still
    logs in. ``password`` sets that one, ``rotate`` a new generated one; otherwise an existing
    login is left as it is: a second `make run`, even one that cannot start, must not lock out
    whoever uses the first."""
    path = saved_in / DEMO_LOGIN_FILE
    user = User.objects.filter(username=username).first()
    if user is not None and not password and not rotate:
        saved = _demo_login_read(path)
        if saved.get("username") == username and user.check_password(saved.get("password")):
            return saved["password"], "kept"
        return None, "kept"
    _, password = user_with_role(username, OPERATOR, password or None)
    # Written as 0600 from the start: no moment where another user could read it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"username": username, "password": password}, out)
    return password, "created" if user is None else "rotated" if rotate else "set"


def _demo_login_read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
