"""The three roles: viewer reads, operator remediates and approves, admin does everything."""

from __future__ import annotations

import secrets

from django.contrib.auth.models import Group, Permission, User

from collectors.push import AGENT_SOURCES, INGEST_SOURCES, PushRights

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
# A node agent: may push signals, for its own node only (its user is "agent:<node>").
AGENT = "agent"
AGENT_PREFIX = "agent:"


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
    return user


def agent_node(user: User) -> str | None:
    """The node an agent user may push for; ``None`` for people."""
    if user.username.startswith(AGENT_PREFIX) and user.groups.filter(name=AGENT).exists():
        return user.username[len(AGENT_PREFIX):]
    return None


def push_rights(user: User) -> PushRights:
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
    return user, password
