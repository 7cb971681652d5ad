"""scopewire's schema: the single definition of every table.

Table and field names follow the seeds (workspace-multi-tenant.md §10,
scope-model.md §3, service-account.md §5.1).  Every tenant row carries a
non-null `workspace_id`, and references between tenant rows are composite
foreign keys through `workspace_id`, so a row can never point into another
workspace.  Where the seeds say `*_uuid` we use `*_id` holding a prefixed id
(storage/ids.py).
"""

from __future__ import annotations

from domain.service_accounts import APPROVALS_SLUG, MESSAGE_WRITE, SERVICE_ACCOUNT_SLUG
from storage.ids import sql_check
from storage.schema_dsl import (Check, Column, Exclude, ForeignKey, Index, Schema, Table, Unique, Version,
                                introduced_in)

TS = "timestamptz"
NOW = "now()"


def id_check(table: str, column: str, prefix: str, since: int = 1) -> Check:
    return Check(f"{table}_{column}_format", sql_check(column, prefix), since=since)


def enum_check(table: str, column: str, values: tuple[str, ...], since: int = 1) -> Check:
    allowed = ", ".join(f"'{v}'" for v in values)
    return Check(f"{table}_{column}_valid", f"{column} IN ({allowed})", since=since)


def tenant_fk(table: str, columns: tuple[str, ...], ref_table: str, ref_columns: tuple[str, ...], name: str,
              on_delete: str | None = None) -> ForeignKey:
    return ForeignKey(f"{table}_{name}_fkey", columns, ref_table, ref_columns, on_delete=on_delete)


def member_fk(table: str, column: str) -> ForeignKey:
    """A reference to a member of the same workspace."""
    return tenant_fk(table, ("workspace_id", column), "members", ("workspace_id", "id"), column.removesuffix("_id"))


def timestamps() -> tuple[Column, Column]:
    return Column("created_at", TS, default=NOW), Column("updated_at", TS, default=NOW)


# btree_gist: the membership interval exclusion; pg_trgm: installed since version 1 (see
# storage/search.py for why search indexes unsegmented text as bigrams instead).
EXTENSIONS = ("btree_gist", "pg_trgm")
ROLES = ("owner", "admin", "developer", "operator", "viewer")
SCOPE_TYPES = ("channel", "dm", "thread", "task", "service_account", "workflow")
DELIVERY_POLICIES = (
    "inline_ordinary",
    "autonomous_store_recoverable",
    "inline_targeted",
    "worker_first_targeted",
    "worker_first_mutation",
)

# --- tenancy (workspace-multi-tenant.md §10) --------------------------------------------

# One row, written by `scopewire init` in the same transaction as the first
# account, workspace and owner membership (§4.2): the instance's identity and
# edition policy.
instance_metadata = Table(
    "instance_metadata",
    columns=(
        Column("singleton", "boolean", default="true"),
        Column("instance_id", "text"),
        Column("edition", "text"),
        Column("initialized_at", TS, default=NOW),
        # The deployment-level provisioning generation boundary (service-account §2.4): Platform Account
        # create and Workspace create each lock this row, advance it and record their input.
        Column("platform_provisioning_generation", "bigint", default="0", since=5),
    ),
    primary_key=("singleton",),
    checks=(
        Check("instance_metadata_singleton_true", "singleton"),
        enum_check("instance_metadata", "edition", ("single", "multi")),
        Check("instance_metadata_platform_generation", "platform_provisioning_generation >= 0", since=5),
    ),
)

accounts = Table(
    "accounts",
    columns=(
        Column("id", "text"),
        Column("email_normalized", "text"),
        Column("display_name", "text"),
        Column("avatar_url", "text", nullable=True),
        Column("status", "text", default="'active'"),
        Column("source", "text", default="'local'"),
        Column("projection_revision", "bigint", default="0"),
        # Bumping this revokes every session token issued to the account.
        Column("token_version", "bigint", default="1"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(Unique("accounts_email_normalized_key", ("email_normalized",)),),
    checks=(
        id_check("accounts", "id", "acc"),
        enum_check("accounts", "status", ("active", "disabled", "deleted")),
        enum_check("accounts", "source", ("local", "cloud_projection")),
        Check("accounts_email_normalized_form", "email_normalized = lower(btrim(email_normalized)) AND email_normalized LIKE '_%@_%'"),
        Check("accounts_display_name_length", "char_length(display_name) BETWEEN 1 AND 200"),
        Check("accounts_token_version_positive", "token_version >= 1"),
    ),
)

local_credentials = Table(
    "local_credentials",
    columns=(
        Column("account_id", "text"),
        Column("password_hash", "text"),
        Column("password_updated_at", TS, default=NOW),
    ),
    primary_key=("account_id",),
    foreign_keys=(ForeignKey("local_credentials_account_fkey", ("account_id",), "accounts", ("id",), on_delete="CASCADE"),),
)

workspaces = Table(
    "workspaces",
    columns=(
        Column("id", "text"),
        Column("instance_id", "text"),
        Column("name", "text"),
        Column("slug", "text"),
        Column("type", "text"),
        Column("status", "text", default="'provisioning'"),
        Column("created_by_account_id", "text"),
        Column("source", "text", default="'local'"),
        Column("projection_revision", "bigint", default="0"),
        # Set to 1 for every workspace created under the single-workspace edition, so
        # the unique key refuses a second one at the database level (§10.2).
        Column("single_edition_slot", "smallint", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("workspaces_slug_key", ("slug",)),
        Unique("workspaces_single_edition_slot_key", ("single_edition_slot",)),
    ),
    checks=(
        id_check("workspaces", "id", "wsp"),
        enum_check("workspaces", "type", ("personal", "team")),
        enum_check("workspaces", "status", ("provisioning", "active", "suspended", "archived", "deleted")),
        enum_check("workspaces", "source", ("local", "cloud_projection")),
        Check("workspaces_single_edition_slot_valid", "single_edition_slot IS NULL OR single_edition_slot = 1"),
        Check("workspaces_slug_form", "slug ~ '^[a-z0-9][a-z0-9-]{0,62}$'"),
        Check("workspaces_name_length", "char_length(name) BETWEEN 1 AND 200"),
    ),
    foreign_keys=(ForeignKey("workspaces_created_by_account_fkey", ("created_by_account_id",), "accounts", ("id",)),),
)

workspace_execution_states = Table(
    "workspace_execution_states",
    columns=(
        Column("workspace_id", "text"),
        Column("instance_id", "text"),
        Column("active_generation", "bigint", default="1"),
        Column("state", "text", default="'active'"),
        Column("write_fenced", "boolean", default="false"),
        Column("source", "text", default="'local'"),
        Column("desired_state_revision", "bigint", default="0"),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id",),
    checks=(
        Check("workspace_execution_states_generation_positive", "active_generation >= 1"),
        enum_check("workspace_execution_states", "state", ("provisioning", "active", "migrating", "draining", "inactive")),
        enum_check("workspace_execution_states", "source", ("local", "cloud")),
    ),
    foreign_keys=(ForeignKey("workspace_execution_states_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),),
)

workspace_memberships = Table(
    "workspace_memberships",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("account_id", "text"),
        Column("role", "text"),
        Column("status", "text", default="'active'"),
        Column("invited_by_account_id", "text", nullable=True),
        Column("joined_at", TS, default=NOW),
        # The membership revision: bumped by every role/status change.
        Column("projection_revision", "bigint", default="1"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("workspace_memberships_workspace_account_key", ("workspace_id", "account_id")),
        Unique("workspace_memberships_workspace_id_key", ("workspace_id", "id")),
    ),
    checks=(
        id_check("workspace_memberships", "id", "wmb"),
        enum_check("workspace_memberships", "role", ROLES),
        enum_check("workspace_memberships", "status", ("active", "disabled", "removed")),
    ),
    foreign_keys=(
        ForeignKey("workspace_memberships_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        ForeignKey("workspace_memberships_account_fkey", ("account_id",), "accounts", ("id",)),
        ForeignKey("workspace_memberships_invited_by_fkey", ("invited_by_account_id",), "accounts", ("id",)),
    ),
    indexes=(
        Index("workspace_memberships_account_idx", "account_id, status"),
        Index("workspace_memberships_active_owner_idx", "workspace_id", where="role = 'owner' AND status = 'active'"),
    ),
)

members = Table(
    "members",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("kind", "text"),
        Column("account_id", "text", nullable=True),
        Column("workspace_membership_id", "text", nullable=True),
        Column("owner_member_id", "text", nullable=True),
        Column("visibility", "text", nullable=True),
        Column("handle", "text"),
        Column("display_name", "text"),
        Column("status", "text", default="'active'"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("members_workspace_id_key", ("workspace_id", "id")),
        Unique("members_workspace_handle_key", ("workspace_id", "handle")),
        Unique("members_workspace_membership_key", ("workspace_membership_id",)),
    ),
    checks=(
        id_check("members", "id", "mem"),
        enum_check("members", "kind", ("human", "agent", "service")),
        enum_check("members", "status", ("active", "disabled", "removed")),
        # Same grammar as the routing-token parser (actors/routing_tokens.py): no trailing '.' or '-'.
        Check("members_handle_form", "handle ~ '^[a-z0-9]([a-z0-9_.-]{0,62}[a-z0-9_])?$'"),
        Check("members_display_name_length", "char_length(display_name) BETWEEN 1 AND 200"),
        Check("members_human_has_account",
              "(kind = 'human') = (account_id IS NOT NULL AND workspace_membership_id IS NOT NULL)"),
        Check("members_agent_has_owner", "(kind = 'agent') = (owner_member_id IS NOT NULL)"),
        Check("members_agent_visibility",
              "(kind = 'agent' AND visibility IN ('public', 'private')) OR (kind <> 'agent' AND visibility IS NULL)"),
    ),
    foreign_keys=(
        ForeignKey("members_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        ForeignKey("members_account_fkey", ("account_id",), "accounts", ("id",)),
        tenant_fk("members", ("workspace_id", "workspace_membership_id"), "workspace_memberships",
                  ("workspace_id", "id"), "workspace_membership"),
        member_fk("members", "owner_member_id"),
    ),
    indexes=(
        Index("members_workspace_account_idx", "workspace_id, account_id", where="account_id IS NOT NULL"),
        Index("members_owner_idx", "workspace_id, owner_member_id", where="owner_member_id IS NOT NULL"),
        # The `@prefix` resolver (collaborator-policy.md §5.1): a handle-prefix range
        # over private agents only, in byte order whatever the database collation.
        Index("members_private_agent_handle_idx", "workspace_id, handle text_pattern_ops",
              where="kind = 'agent' AND visibility = 'private'", since=2),
    ),
)

workspace_invitations = Table(
    "workspace_invitations",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("normalized_email", "text"),
        Column("role", "text"),
        # sha256 of the token; the token itself is never stored.
        Column("token_hash", "bytea"),
        Column("status", "text", default="'pending'"),
        Column("expires_at", TS),
        Column("accepted_at", TS, nullable=True),
        Column("accepted_by_account_id", "text", nullable=True),
        Column("revoked_at", TS, nullable=True),
        Column("created_by_account_id", "text"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(Unique("workspace_invitations_token_hash_key", ("token_hash",)),),
    checks=(
        id_check("workspace_invitations", "id", "inv"),
        # Invitations never grant owner (owner transfer is its own operation).
        enum_check("workspace_invitations", "role", ROLES[1:]),
        enum_check("workspace_invitations", "status", ("pending", "accepted", "revoked", "expired")),
        Check("workspace_invitations_token_hash_length", "octet_length(token_hash) = 32"),
        Check("workspace_invitations_accepted_state",
              "(status = 'accepted') = (accepted_at IS NOT NULL AND accepted_by_account_id IS NOT NULL)"),
        Check("workspace_invitations_revoked_state", "(status = 'revoked') = (revoked_at IS NOT NULL)"),
    ),
    foreign_keys=(
        ForeignKey("workspace_invitations_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        ForeignKey("workspace_invitations_created_by_fkey", ("created_by_account_id",), "accounts", ("id",)),
        ForeignKey("workspace_invitations_accepted_by_fkey", ("accepted_by_account_id",), "accounts", ("id",)),
    ),
    indexes=(
        # One live invitation per (workspace, email).
        Index("workspace_invitations_pending_email_key", "workspace_id, normalized_email", unique=True,
              where="status = 'pending'"),
    ),
)

api_keys = Table(
    "api_keys",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("member_id", "text"),
        Column("created_by_account_id", "text", nullable=True),
        Column("name", "text"),
        Column("key_hash", "bytea"),
        Column("scopes", "text[]", default="'{}'::text[]"),
        Column("status", "text", default="'active'"),
        Column("expires_at", TS, nullable=True),
        Column("last_used_at", TS, nullable=True),
        Column("revoked_at", TS, nullable=True),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    uniques=(Unique("api_keys_key_hash_key", ("key_hash",)),),
    checks=(
        id_check("api_keys", "id", "key"),
        enum_check("api_keys", "status", ("active", "revoked")),
        Check("api_keys_key_hash_length", "octet_length(key_hash) = 32"),
        Check("api_keys_revoked_state", "(status = 'revoked') = (revoked_at IS NOT NULL)"),
        Check("api_keys_name_length", "char_length(name) BETWEEN 1 AND 200"),
    ),
    foreign_keys=(
        ForeignKey("api_keys_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        member_fk("api_keys", "member_id"),
        ForeignKey("api_keys_created_by_fkey", ("created_by_account_id",), "accounts", ("id",)),
    ),
    indexes=(Index("api_keys_workspace_member_idx", "workspace_id, member_id"),),
)

# --- message domain (scope-model.md §3) ------------------------------------------------

scopes = Table(
    "scopes",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("type", "text"),
        Column("parent_scope_id", "text", nullable=True),
        Column("root_message_id", "text", nullable=True),
        Column("root_message_short_id", "text", nullable=True),
        Column("identity_key", "text", nullable=True),
        Column("latest_seq", "bigint", default="0"),
        Column("latest_global_seq", "bigint", default="0"),
        Column("latest_message_at", TS, nullable=True),
        Column("roster_generation", "bigint", default="0"),
        Column("archived_until_seq", "bigint", nullable=True),
        Column("status", "text", default="'active'"),
        Column("created_by_member_id", "text", nullable=True),
        *timestamps(),
        Column("archived_at", TS, nullable=True),
    ),
    primary_key=("id",),
    uniques=(
        Unique("scopes_workspace_id_key", ("workspace_id", "id")),
        Unique("scopes_workspace_id_type_key", ("workspace_id", "id", "type")),
        Unique("scopes_identity_key_key", ("identity_key",)),
    ),
    checks=(
        id_check("scopes", "id", "scp"),
        enum_check("scopes", "type", SCOPE_TYPES),
        enum_check("scopes", "status", ("active", "archived", "deleted")),
        Check("scopes_thread_shape",
              "(type = 'thread') = (parent_scope_id IS NOT NULL AND root_message_id IS NOT NULL)"),
        Check("scopes_identity_key_shape",
              "(type IN ('dm', 'service_account', 'workflow')) = (identity_key IS NOT NULL)"),
        Check("scopes_counters_nonnegative",
              "latest_seq >= 0 AND latest_global_seq >= 0 AND roster_generation >= 0"),
        Check("scopes_archived_state", "(status = 'archived') = (archived_at IS NOT NULL)"),
    ),
    foreign_keys=(
        ForeignKey("scopes_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        tenant_fk("scopes", ("workspace_id", "parent_scope_id"), "scopes", ("workspace_id", "id"), "parent_scope"),
        # The root message lives in the parent scope.
        tenant_fk("scopes", ("parent_scope_id", "root_message_id"), "scope_messages", ("scope_id", "id"), "root_message"),
        member_fk("scopes", "created_by_member_id"),
    ),
    indexes=(
        # One thread per root message.
        Index("scopes_thread_root_key", "parent_scope_id, root_message_id", unique=True,
              where="parent_scope_id IS NOT NULL"),
        Index("scopes_workspace_type_idx", "workspace_id, type, status"),
    ),
)

scope_channel_profiles = Table(
    "scope_channel_profiles",
    columns=(
        Column("scope_id", "text"),
        Column("workspace_id", "text"),
        # Always 'channel': with the composite key below only channel scopes have a profile.
        Column("scope_type", "text", default="'channel'"),
        Column("slug", "text"),
        Column("display_name", "text"),
        Column("description", "text", default="''"),
        Column("visibility", "text"),
        Column("owner_member_id", "text", nullable=True),
        Column("is_all_channel", "boolean", default="false"),
        *timestamps(),
    ),
    primary_key=("scope_id",),
    uniques=(Unique("scope_channel_profiles_workspace_slug_key", ("workspace_id", "slug")),),
    checks=(
        Check("scope_channel_profiles_scope_type_channel", "scope_type = 'channel'"),
        enum_check("scope_channel_profiles", "visibility", ("public", "private")),
        Check("scope_channel_profiles_slug_form", "slug ~ '^[a-z0-9][a-z0-9_-]{0,79}$'"),
        Check("scope_channel_profiles_display_name_length", "char_length(display_name) BETWEEN 1 AND 200"),
        Check("scope_channel_profiles_description_length", "char_length(description) <= 4000"),
    ),
    foreign_keys=(
        tenant_fk("scope_channel_profiles", ("workspace_id", "scope_id", "scope_type"), "scopes",
                  ("workspace_id", "id", "type"), "scope"),
        member_fk("scope_channel_profiles", "owner_member_id"),
    ),
    indexes=(
        Index("scope_channel_profiles_all_channel_key", "workspace_id", unique=True, where="is_all_channel"),
    ),
)

scope_memberships = Table(
    "scope_memberships",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("member_id", "text"),
        Column("visibility", "text", default="'public'"),
        Column("owner_member_id", "text", nullable=True),
        Column("last_read_seq", "bigint", default="0"),
        Column("last_read_global_seq", "bigint", default="0"),
        Column("owner_context_dismissed_through_global_seq", "bigint", default="0"),
        Column("effective_from_seq", "bigint"),
        # Inclusive; NULL while the membership is open.
        Column("effective_to_seq", "bigint", nullable=True),
        *timestamps(),
        Column("removed_at", TS, nullable=True),
        Column("archived_at", TS, nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("scope_memberships", "id", "smb"),
        Check("scope_memberships_visibility_valid", "visibility IN ('public', 'private')", until=6),
        # 'participant': a task scope's state-only row (read cursor, Inbox), which grants
        # nothing: a task's readers are its board channel's members (collaborator-policy §4.2.1).
        Check("scope_memberships_visibility_known", "visibility IN ('public', 'private', 'participant')", since=6),
        Check("scope_memberships_private_owner", "(visibility = 'private') = (owner_member_id IS NOT NULL)"),
        Check("scope_memberships_interval",
              "effective_from_seq >= 1 AND (effective_to_seq IS NULL OR effective_to_seq >= effective_from_seq - 1)"),
        Check("scope_memberships_read_cursor", "last_read_seq >= 0 AND last_read_global_seq >= 0"),
    ),
    excludes=(
        # At most one effective membership per (scope, member) at any seq.  The
        # inclusive end becomes an exclusive bound, so a join-then-leave with no
        # message in between is an empty interval.
        Exclude("scope_memberships_no_overlap", "gist",
                "scope_id WITH =, member_id WITH =, int8range(effective_from_seq, effective_to_seq + 1) WITH &&"),
    ),
    foreign_keys=(
        tenant_fk("scope_memberships", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_memberships", "member_id"),
        member_fk("scope_memberships", "owner_member_id"),
    ),
    indexes=(
        Index("scope_memberships_open_key", "scope_id, member_id", unique=True, where="effective_to_seq IS NULL"),
        Index("scope_memberships_member_open_idx", "workspace_id, member_id, scope_id", where="effective_to_seq IS NULL"),
        Index("scope_memberships_member_history_idx", "member_id, scope_id, effective_from_seq"),
    ),
)

scope_notification_settings = Table(
    "scope_notification_settings",
    columns=(
        Column("scope_id", "text"),
        Column("member_id", "text"),
        Column("workspace_id", "text"),
        Column("state", "text", default="'active'"),
        *timestamps(),
    ),
    primary_key=("scope_id", "member_id"),
    checks=(enum_check("scope_notification_settings", "state", ("active", "quiet", "mute", "auto-wake", "no-wake")),),
    foreign_keys=(
        tenant_fk("scope_notification_settings", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_notification_settings", "member_id"),
    ),
    indexes=(Index("scope_notification_settings_member_idx", "workspace_id, member_id"),),
)

scope_private_grants = Table(
    "scope_private_grants",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("owner_member_id", "text"),
        Column("grantee_member_id", "text"),
        Column("granted_by_member_id", "text"),
        Column("created_at", TS, default=NOW),
        Column("expires_at", TS, nullable=True),
        Column("revoked_at", TS, nullable=True),
        # The grant's readable window in workspace_global_seq (SPEC §5.7): from the
        # next global seq when it was granted, to the last one before it was revoked
        # (or, for an expired grant, an upper bound the expiry sweep records; the
        # exact expiry test is created_at < expires_at).  Windows are never moved
        # backwards: revocation and expiry are not retroactive.
        Column("effective_from_global_seq", "bigint", default="0", since=2),
        Column("effective_to_global_seq", "bigint", nullable=True, since=2),
        Column("revoked_by_member_id", "text", nullable=True, since=2),
    ),
    primary_key=("id",),
    checks=(
        id_check("scope_private_grants", "id", "grt"),
        Check("scope_private_grants_not_self", "owner_member_id <> grantee_member_id"),
        Check("scope_private_grants_revoked_window", "revoked_at IS NULL OR effective_to_global_seq IS NOT NULL",
              since=2),
        Check("scope_private_grants_window_order",
              "effective_from_global_seq >= 0 AND (effective_to_global_seq IS NULL "
              "OR effective_to_global_seq >= effective_from_global_seq - 1)", since=2),
        Check("scope_private_grants_expiry_after_creation", "expires_at IS NULL OR expires_at > created_at",
              since=2),
    ),
    foreign_keys=(
        tenant_fk("scope_private_grants", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_private_grants", "owner_member_id"),
        member_fk("scope_private_grants", "grantee_member_id"),
        member_fk("scope_private_grants", "granted_by_member_id"),
        ForeignKey("scope_private_grants_revoked_by_fkey", ("workspace_id", "revoked_by_member_id"), "members",
                   ("workspace_id", "id"), since=2),
    ),
    indexes=(
        # One live grant per (scope, owner, grantee); an expired one is revoked before a re-grant.
        Index("scope_private_grants_live_key", "scope_id, owner_member_id, grantee_member_id", unique=True,
              where="revoked_at IS NULL"),
        Index("scope_private_grants_grantee_idx", "workspace_id, grantee_member_id"),
        # The readable predicate: every window (ended ones too) of an (owner, author) pair.
        Index("scope_private_grants_owner_grantee_idx", "scope_id, owner_member_id, grantee_member_id",
              since=2),
        Index("scope_private_grants_expiring_idx", "expires_at",
              where="revoked_at IS NULL AND effective_to_global_seq IS NULL AND expires_at IS NOT NULL", since=2),
    ),
)

scope_messages = Table(
    "scope_messages",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("seq", "bigint"),
        Column("workspace_global_seq", "bigint"),
        Column("author_member_id", "text"),
        Column("author_type", "text"),
        Column("notify_principal_member_id", "text"),
        Column("idempotency_subject_member_id", "text"),
        Column("client_message_id", "text", nullable=True),
        Column("idempotency_payload_digest", "bytea", nullable=True),
        Column("message_type", "text"),
        Column("content", "text"),
        Column("metadata", "jsonb", default="'{}'::jsonb"),
        # The last committed revision is canonical; every revision is kept in scope_message_revisions.
        Column("revision", "integer", default="1"),
        # Withdrawal is a terminal tombstone: id, seq and read frontier stay.
        Column("state", "text", default="'visible'"),
        Column("withdrawn_at", TS, nullable=True),
        Column("withdrawn_by_member_id", "text", nullable=True),
        Column("thread_scope_id", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("scope_messages_scope_seq_key", ("scope_id", "seq")),
        Unique("scope_messages_workspace_global_seq_key", ("workspace_id", "workspace_global_seq")),
        Unique("scope_messages_workspace_id_key", ("workspace_id", "id")),
        Unique("scope_messages_scope_id_key", ("scope_id", "id")),
        # NULL client_message_id rows are distinct, so only keyed sends are constrained.
        Unique("scope_messages_idempotency_key",
               ("scope_id", "author_member_id", "idempotency_subject_member_id", "client_message_id")),
    ),
    checks=(
        id_check("scope_messages", "id", "msg"),
        Check("scope_messages_seq_positive", "seq >= 1 AND workspace_global_seq >= 1"),
        enum_check("scope_messages", "author_type", ("human", "agent", "service")),
        Check("scope_messages_idempotency_pair",
              "(client_message_id IS NULL) = (idempotency_payload_digest IS NULL)"),
        Check("scope_messages_client_message_id_length", "char_length(client_message_id) BETWEEN 1 AND 128"),
        Check("scope_messages_content_length", "char_length(content) <= 40000"),
        Check("scope_messages_metadata_object", "jsonb_typeof(metadata) = 'object'"),
        Check("scope_messages_revision_positive", "revision >= 1"),
        enum_check("scope_messages", "state", ("visible", "withdrawn")),
        Check("scope_messages_withdrawn_state",
              "(state = 'withdrawn') = (withdrawn_at IS NOT NULL AND withdrawn_by_member_id IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("scope_messages", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_messages", "author_member_id"),
        member_fk("scope_messages", "notify_principal_member_id"),
        member_fk("scope_messages", "idempotency_subject_member_id"),
        member_fk("scope_messages", "withdrawn_by_member_id"),
        tenant_fk("scope_messages", ("workspace_id", "thread_scope_id"), "scopes", ("workspace_id", "id"),
                  "thread_scope"),
    ),
    indexes=(
        Index("scope_messages_author_idx", "workspace_id, author_member_id, created_at"),
        # Owner-private context scans (collaborator-policy.md §8.6): one author's
        # messages in one scope by global seq (== seq order within a scope).
        Index("scope_messages_scope_author_idx", "scope_id, author_member_id, workspace_global_seq, seq", since=2),
    ),
)

scope_message_revisions = Table(
    "scope_message_revisions",
    columns=(
        Column("message_id", "text"),
        Column("revision", "integer"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("content", "text"),
        Column("metadata", "jsonb", default="'{}'::jsonb"),
        Column("edited_by_member_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("message_id", "revision"),
    checks=(
        Check("scope_message_revisions_revision_positive", "revision >= 1"),
        Check("scope_message_revisions_content_length", "char_length(content) <= 40000"),
    ),
    foreign_keys=(
        tenant_fk("scope_message_revisions", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message"),
        tenant_fk("scope_message_revisions", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_message_revisions", "edited_by_member_id"),
    ),
)

# The per-workspace allocator of workspace_global_seq and activity_global_seq.  Its
# row lock is held from allocation to commit, so within one workspace the
# allocation order is the commit order: a reader paging by global seq never
# skips a message that commits later with a smaller number.
workspace_message_counters = Table(
    "workspace_message_counters",
    columns=(
        Column("workspace_id", "text"),
        Column("latest_global_seq", "bigint", default="0"),
        Column("latest_activity_global_seq", "bigint", default="0"),
    ),
    primary_key=("workspace_id",),
    checks=(Check("workspace_message_counters_nonnegative",
                  "latest_global_seq >= 0 AND latest_activity_global_seq >= 0"),),
    foreign_keys=(ForeignKey("workspace_message_counters_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),),
)

scope_message_sources = Table(
    "scope_message_sources",
    columns=(
        Column("message_id", "text"),
        Column("ordinal", "integer"),
        Column("workspace_id", "text"),
        Column("target_scope_id", "text"),
        Column("source_scope_id", "text", nullable=True),
        Column("source_seq", "bigint", nullable=True),
        Column("source_message_id", "text", nullable=True),
        Column("source_kind", "text"),
        Column("source_dedupe_key", "text", nullable=True),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("message_id", "ordinal"),
    uniques=(Unique("scope_message_sources_dedupe_key", ("message_id", "source_dedupe_key")),),
    checks=(
        Check("scope_message_sources_ordinal_nonnegative", "ordinal >= 0"),
        enum_check("scope_message_sources", "source_kind",
                   ("reply", "quote", "forward", "multi_forward", "owner_quote", "explicit_context")),
    ),
    foreign_keys=(
        tenant_fk("scope_message_sources", ("target_scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message"),
        tenant_fk("scope_message_sources", ("workspace_id", "target_scope_id"), "scopes", ("workspace_id", "id"),
                  "target_scope"),
        tenant_fk("scope_message_sources", ("workspace_id", "source_message_id"), "scope_messages",
                  ("workspace_id", "id"), "source_message"),
        tenant_fk("scope_message_sources", ("workspace_id", "source_scope_id"), "scopes", ("workspace_id", "id"),
                  "source_scope"),
    ),
    indexes=(
        Index("scope_message_sources_source_idx", "workspace_id, source_message_id",
              where="source_message_id IS NOT NULL"),
        # What owners shared out of a scope (a private agent's source_ref reads).
        Index("scope_message_sources_owner_quote_idx", "source_scope_id", where="source_kind = 'owner_quote'",
              since=2),
    ),
)

scope_activity_events = Table(
    "scope_activity_events",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("activity_type", "text"),
        Column("activity_ref_type", "text"),
        Column("activity_ref_id", "text"),
        Column("activity_global_seq", "bigint"),
        Column("source_message_id", "text", nullable=True),
        Column("actor_member_id", "text", nullable=True),
        Column("reason", "text", nullable=True),
        Column("payload", "jsonb", default="'{}'::jsonb"),
        Column("created_at", TS, default=NOW),
        Column("suppressed_at", TS, nullable=True),
    ),
    primary_key=("id",),
    uniques=(Unique("scope_activity_events_workspace_global_seq_key", ("workspace_id", "activity_global_seq")),),
    checks=(
        id_check("scope_activity_events", "id", "act"),
        Check("scope_activity_events_global_seq_positive", "activity_global_seq >= 1"),
        Check("scope_activity_events_payload_object", "jsonb_typeof(payload) = 'object'"),
    ),
    foreign_keys=(
        tenant_fk("scope_activity_events", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        tenant_fk("scope_activity_events", ("workspace_id", "source_message_id"), "scope_messages",
                  ("workspace_id", "id"), "source_message"),
        member_fk("scope_activity_events", "actor_member_id"),
    ),
    indexes=(
        Index("scope_activity_events_scope_idx", "scope_id, activity_global_seq"),
        Index("scope_activity_events_ref_idx", "workspace_id, activity_ref_type, activity_ref_id"),
    ),
)

scope_fanout_outbox = Table(
    "scope_fanout_outbox",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("message_id", "text", nullable=True),
        Column("event_ref_type", "text"),
        Column("event_ref_id", "text"),
        Column("fanout_type", "text"),
        Column("delivery_policy", "text"),
        Column("dedupe_key", "text"),
        Column("payload", "jsonb", default="'{}'::jsonb"),
        Column("status", "text", default="'pending'"),
        Column("attempts", "integer", default="0"),
        Column("max_attempts", "integer", default="10"),
        Column("next_attempt_at", TS, default=NOW),
        Column("lease_owner", "text", nullable=True),
        Column("lease_expires_at", TS, nullable=True),
        # The workspace execution generation the producing write committed under (§10.3).
        Column("execution_generation", "bigint"),
        Column("created_at", TS, default=NOW),
        Column("delivered_at", TS, nullable=True),
        Column("suppressed_at", TS, nullable=True),
        Column("suppression_reason", "text", nullable=True),
        Column("last_error", "text", nullable=True),
    ),
    primary_key=("id",),
    uniques=(Unique("scope_fanout_outbox_dedupe_key_key", ("dedupe_key",)),),
    checks=(
        id_check("scope_fanout_outbox", "id", "obx"),
        enum_check("scope_fanout_outbox", "status", ("pending", "leased", "delivered", "failed", "suppressed")),
        enum_check("scope_fanout_outbox", "delivery_policy", DELIVERY_POLICIES),
        Check("scope_fanout_outbox_attempts", "attempts >= 0 AND max_attempts >= 1"),
        Check("scope_fanout_outbox_lease_state",
              "(status = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)"),
        Check("scope_fanout_outbox_suppressed_state", "(status = 'suppressed') = (suppressed_at IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("scope_fanout_outbox", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        tenant_fk("scope_fanout_outbox", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"), "message"),
    ),
    indexes=(
        # The worker's lease scan: only live rows, in due order.
        Index("scope_fanout_outbox_due_idx", "next_attempt_at", where="status IN ('pending', 'leased')"),
        Index("scope_fanout_outbox_message_idx", "scope_id, message_id", where="message_id IS NOT NULL"),
    ),
)

scope_message_reactions = Table(
    "scope_message_reactions",
    columns=(
        Column("message_id", "text"),
        Column("member_id", "text"),
        Column("reaction_key", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("message_id", "member_id", "reaction_key"),
    checks=(Check("scope_message_reactions_key_length", "char_length(reaction_key) BETWEEN 1 AND 128"),),
    foreign_keys=(
        tenant_fk("scope_message_reactions", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message"),
        tenant_fk("scope_message_reactions", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_message_reactions", "member_id"),
    ),
    indexes=(Index("scope_message_reactions_member_idx", "workspace_id, member_id"),),
)

conversation_member_states = Table(
    "conversation_member_states",
    columns=(
        Column("workspace_id", "text"),
        Column("member_id", "text"),
        Column("scope_id", "text"),
        Column("pinned_at", TS, nullable=True),
        Column("hidden_at", TS, nullable=True),
        # Hidden rows come back when a message newer than this seq arrives.
        Column("hidden_through_seq", "bigint", nullable=True),
        Column("manual_unread_at", TS, nullable=True),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id", "member_id", "scope_id"),
    checks=(Check("conversation_member_states_hidden_state", "(hidden_at IS NULL) = (hidden_through_seq IS NULL)"),),
    foreign_keys=(
        member_fk("conversation_member_states", "member_id"),
        tenant_fk("conversation_member_states", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"),
                  "scope"),
    ),
)

# --- owner-private collaboration (collaborator-policy.md §8) -------------------------------

# An owner's private-agent execution container on a channel, thread or explicit
# task (§3.0).  Created lazily, only by the writes §3.0 lists (the first
# collaborator, the first owner/collaborator wake, the first owner_quote share;
# never by a read: SPEC §5 decision 8); an owner-only scope has none.
scope_executions = introduced_in(2, Table(
    "scope_executions",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("owner_member_id", "text"),
        Column("scope_type", "text"),
        Column("scope_id", "text"),
        Column("created_trigger", "text"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("scope_executions_owner_scope_key", ("owner_member_id", "scope_type", "scope_id")),
        Unique("scope_executions_workspace_id_key", ("workspace_id", "id")),
    ),
    checks=(
        id_check("scope_executions", "id", "sex"),
        enum_check("scope_executions", "scope_type", ("channel", "thread", "explicit_task")),
        enum_check("scope_executions", "created_trigger",
                   ("first_collaborator", "wake", "owner_quote")),
    ),
    foreign_keys=(
        tenant_fk("scope_executions", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
        member_fk("scope_executions", "owner_member_id"),
    ),
    indexes=(Index("scope_executions_scope_owner_idx", "scope_id, owner_member_id"),),
))

# People collaborators (§8.2): an owner's explicit grant to one human or
# installed-app member, on one Scope Execution.  Effective collaborators of a
# thread or task are the runtime union along the source chain; no row is copied.
task_scope_participant_metadata = introduced_in(2, Table(
    "task_scope_participant_metadata",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("owner_scope_execution_id", "text"),
        Column("member_id", "text"),
        Column("role", "text", default="'collaborator'"),
        Column("added_by_member_id", "text"),
        Column("added_at", TS, default=NOW),
        Column("expires_at", TS, nullable=True),
        Column("left_at", TS, nullable=True),
        Column("removed_at", TS, nullable=True),
        # Same windows as scope_private_grants: from the next global seq at added_at.
        Column("effective_from_global_seq", "bigint"),
        Column("effective_to_global_seq", "bigint", nullable=True),
        # member_id while the collaborator is active, NULL once ended: one active row per pair.
        Column("active_key", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("task_scope_participant_metadata_active_key", ("owner_scope_execution_id", "active_key")),
        Unique("task_scope_participant_metadata_workspace_id_key", ("workspace_id", "id")),
    ),
    checks=(
        id_check("task_scope_participant_metadata", "id", "col"),
        enum_check("task_scope_participant_metadata", "role", ("collaborator",)),
        Check("task_scope_participant_metadata_active_key_form", "active_key IS NULL OR active_key = member_id"),
        Check("task_scope_participant_metadata_ended_state",
              "(active_key IS NULL) = (effective_to_global_seq IS NOT NULL)"),
        Check("task_scope_participant_metadata_left_or_removed_inactive",
              "(left_at IS NULL AND removed_at IS NULL) OR active_key IS NULL"),
        Check("task_scope_participant_metadata_window_order",
              "effective_from_global_seq >= 0 AND (effective_to_global_seq IS NULL "
              "OR effective_to_global_seq >= effective_from_global_seq - 1)"),
        Check("task_scope_participant_metadata_expiry_after_add", "expires_at IS NULL OR expires_at > added_at"),
    ),
    foreign_keys=(
        tenant_fk("task_scope_participant_metadata", ("workspace_id", "owner_scope_execution_id"),
                  "scope_executions", ("workspace_id", "id"), "owner_scope_execution"),
        member_fk("task_scope_participant_metadata", "member_id"),
        member_fk("task_scope_participant_metadata", "added_by_member_id"),
    ),
    indexes=(
        # The readable predicate and the resolvers: every window of (execution, member).
        Index("task_scope_participant_metadata_execution_member_idx", "owner_scope_execution_id, member_id"),
        # A collaborator's own grants (leave; "which owners let me contribute").
        Index("task_scope_participant_metadata_member_idx", "workspace_id, member_id",
              where="active_key IS NOT NULL"),
        Index("task_scope_participant_metadata_expiring_idx", "expires_at",
              where="active_key IS NOT NULL AND expires_at IS NOT NULL"),
    ),
))

# Cold audit of collaborator changes (§8.8): never read or written by message writes.
task_collaborator_events = introduced_in(2, Table(
    "task_collaborator_events",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("owner_scope_execution_id", "text"),
        Column("target_kind", "text", default="'member'"),
        Column("member_id", "text"),
        Column("event_type", "text"),
        Column("actor_member_id", "text", nullable=True),  # NULL: the system (expiry)
        Column("event_at", TS, default=NOW),
        Column("payload_json", "jsonb", default="'{}'::jsonb"),
    ),
    primary_key=("id",),
    checks=(
        id_check("task_collaborator_events", "id", "cev"),
        enum_check("task_collaborator_events", "target_kind", ("member",)),
        enum_check("task_collaborator_events", "event_type", ("add", "remove", "leave", "expire", "update_expiry")),
        Check("task_collaborator_events_payload_object", "jsonb_typeof(payload_json) = 'object'"),
    ),
    foreign_keys=(
        tenant_fk("task_collaborator_events", ("workspace_id", "owner_scope_execution_id"), "scope_executions",
                  ("workspace_id", "id"), "owner_scope_execution"),
        member_fk("task_collaborator_events", "member_id"),
        member_fk("task_collaborator_events", "actor_member_id"),
    ),
    indexes=(Index("task_collaborator_events_execution_idx", "owner_scope_execution_id, event_at"),),
))

task_collaborator_notification_jobs = introduced_in(2, Table(
    "task_collaborator_notification_jobs",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("owner_scope_execution_id", "text"),
        Column("target_kind", "text", default="'member'"),
        Column("member_id", "text"),
        Column("notification_type", "text"),
        Column("state", "text", default="'pending'"),
        Column("queued_at", TS, default=NOW),
        Column("delivered_at", TS, nullable=True),
        Column("failed_at", TS, nullable=True),
        Column("error_code", "text", nullable=True),
        Column("error_message", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    checks=(
        id_check("task_collaborator_notification_jobs", "id", "cnj"),
        enum_check("task_collaborator_notification_jobs", "target_kind", ("member",)),
        enum_check("task_collaborator_notification_jobs", "notification_type", ("collaborator_added",)),
        enum_check("task_collaborator_notification_jobs", "state", ("pending", "delivered", "failed")),
        Check("task_collaborator_notification_jobs_delivered_state",
              "(state = 'delivered') = (delivered_at IS NOT NULL)"),
        Check("task_collaborator_notification_jobs_failed_state", "(state = 'failed') = (failed_at IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("task_collaborator_notification_jobs", ("workspace_id", "owner_scope_execution_id"),
                  "scope_executions", ("workspace_id", "id"), "owner_scope_execution"),
        member_fk("task_collaborator_notification_jobs", "member_id"),
    ),
    indexes=(Index("task_collaborator_notification_jobs_pending_idx", "queued_at", where="state = 'pending'"),),
))

# Per recipient, the allocator of delivery_seq: the writing transaction holds the
# row until commit, so a recipient's deliveries number in commit order, gap-free.
member_delivery_feeds = introduced_in(3, Table(
    "member_delivery_feeds",
    columns=(
        Column("workspace_id", "text"),
        Column("member_id", "text"),
        Column("latest_delivery_seq", "bigint", default="0"),
    ),
    primary_key=("workspace_id", "member_id"),
    checks=(Check("member_delivery_feeds_seq_nonnegative", "latest_delivery_seq >= 0"),),
    foreign_keys=(member_fk("member_delivery_feeds", "member_id"),),
))

DELIVERY_STATUSES = ("pending", "leased", "acked", "suppressed", "expired", "failed")
DELIVERY_REASONS = ("mention", "recipient", "direct", "auto_wake", "reaction")
# Version 6 (strands): a watcher's notification, an assignment, an audience mention.
STRAND_DELIVERY_REASONS = ("watch", "assignment", "audience_mention")

# The sparse delivery ledger (collaborator-policy §5): one row per recipient of a
# wake only — mentions, explicit recipients, auto-wake, reactions — never per
# reader of an ordinary message.  Its ack/lease state makes delivery at-least-once.
scope_targeted_deliveries = introduced_in(3, Table(
    "scope_targeted_deliveries",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("recipient_member_id", "text"),
        Column("delivery_seq", "bigint"),
        Column("outbox_id", "text"),
        Column("scope_id", "text"),
        Column("message_id", "text", nullable=True),
        Column("activity_event_id", "text", nullable=True),
        Column("reason", "text"),
        Column("authority", "text", nullable=True),
        Column("dedupe_key", "text"),
        Column("push", "boolean"),
        Column("status", "text", default="'pending'"),
        Column("attempts", "integer", default="0"),  # handouts
        # Handouts whose lease ran out unacked on an open connection (a connection
        # that closes gives its deliveries back without counting): at max_attempts it fails.
        Column("lease_expiries", "integer", default="0"),
        Column("max_attempts", "integer", default="10"),
        Column("lease_owner", "text", nullable=True),
        Column("lease_expires_at", TS, nullable=True),
        Column("created_at", TS, default=NOW),
        Column("acked_at", TS, nullable=True),
        Column("suppressed_at", TS, nullable=True),
        Column("suppression_reason", "text", nullable=True),
        # Every reason that picked this member for this message, merged into the one
        # delivery (strand-message §9.4.2): `reason` is the first of them.
        Column("reasons", "text[]", default="'{}'::text[]", since=6),
    ),
    primary_key=("id",),
    uniques=(
        Unique("scope_targeted_deliveries_dedupe_key_key", ("dedupe_key",)),
        Unique("scope_targeted_deliveries_recipient_seq_key", ("workspace_id", "recipient_member_id", "delivery_seq")),
    ),
    checks=(
        id_check("scope_targeted_deliveries", "id", "dlv"),
        enum_check("scope_targeted_deliveries", "status", DELIVERY_STATUSES),
        Check("scope_targeted_deliveries_reason_valid",
              "reason IN (" + ", ".join(f"'{r}'" for r in DELIVERY_REASONS) + ")", until=6),
        Check("scope_targeted_deliveries_reason_known",
              "reason IN (" + ", ".join(f"'{r}'" for r in DELIVERY_REASONS + STRAND_DELIVERY_REASONS) + ")"
              " AND (cardinality(reasons) = 0 OR reasons[1] = reason)", since=6),
        Check("scope_targeted_deliveries_seq_positive", "delivery_seq >= 1"),
        Check("scope_targeted_deliveries_source", "message_id IS NOT NULL OR activity_event_id IS NOT NULL"),
        Check("scope_targeted_deliveries_attempts", "attempts >= 0 AND lease_expiries >= 0 AND max_attempts >= 1"),
        Check("scope_targeted_deliveries_lease_state",
              "(status = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)"),
        Check("scope_targeted_deliveries_acked_state", "(status = 'acked') = (acked_at IS NOT NULL)"),
        Check("scope_targeted_deliveries_suppressed_state",
              "(status IN ('suppressed', 'expired', 'failed')) = (suppressed_at IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("scope_targeted_deliveries", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"),
                  "scope"),
        tenant_fk("scope_targeted_deliveries", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message"),
        tenant_fk("scope_targeted_deliveries", ("activity_event_id",), "scope_activity_events", ("id",),
                  "activity_event"),
        tenant_fk("scope_targeted_deliveries", ("outbox_id",), "scope_fanout_outbox", ("id",), "outbox"),
        tenant_fk("scope_targeted_deliveries", ("workspace_id", "recipient_member_id"), "member_delivery_feeds",
                  ("workspace_id", "member_id"), "feed"),
    ),
    indexes=(
        # A subscribe's replay and the lease sweep: a recipient's unacked pushable deliveries in
        # seq order (quiet ones wait for an ack or expiry and are never handed out).
        Index("scope_targeted_deliveries_unacked_idx", "workspace_id, recipient_member_id, delivery_seq",
              where="status IN ('pending', 'leased') AND push"),
        Index("scope_targeted_deliveries_outbox_idx", "outbox_id"),
        Index("scope_targeted_deliveries_activity_idx", "activity_event_id", where="activity_event_id IS NOT NULL"),
        Index("scope_targeted_deliveries_message_idx", "scope_id, message_id", where="message_id IS NOT NULL"),
        # The retention sweep: the oldest unacked first.
        Index("scope_targeted_deliveries_retention_idx", "created_at", where="status IN ('pending', 'leased')"),
    ),
))

# --- service accounts (service-account.md §2, §7): the Service Actor substrate, workspace accounts,
# --- their create requests and approvals, managers, audit, and the human lifecycle they follow.

SERVICE_ACCOUNT_BUSINESS_STATES = ("submitted", "awaiting_authorization", "authorized", "declined", "cancelled",
                                   "provisioning", "fulfilled", "action_required")

# A product registration shared by every installation of it (§2.1): `service-account`, and the
# built-in `approvals` app that writes approval cards.
service_definitions = introduced_in(4, Table(
    "service_definitions",
    columns=(
        Column("id", "text"),
        Column("service_kind", "text"),
        Column("slug", "text"),
        Column("installation_mode", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    uniques=(Unique("service_definitions_slug_key", ("slug",)),),
    checks=(
        id_check("service_definitions", "id", "sdf"),
        enum_check("service_definitions", "service_kind", ("service_account", "app")),
        enum_check("service_definitions", "installation_mode", ("named_multi_instance", "workspace_singleton")),
    ),
))

service_capabilities = introduced_in(4, Table(
    "service_capabilities",
    columns=(
        Column("id", "text"),
        Column("service_definition_id", "text"),
        Column("capability", "text"),
        Column("delivery_contract", "text"),
    ),
    primary_key=("id",),
    uniques=(Unique("service_capabilities_definition_capability_key", ("service_definition_id", "capability")),),
    checks=(id_check("service_capabilities", "id", "cap"),),
    foreign_keys=(ForeignKey("service_capabilities_definition_fkey", ("service_definition_id",),
                             "service_definitions", ("id",)),),
))

service_installations = introduced_in(4, Table(
    "service_installations",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_definition_id", "text"),
        # service_account: the account's principal id; a singleton app: 'workspace'.
        Column("instance_key", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    uniques=(
        Unique("service_installations_instance_key", ("service_definition_id", "workspace_id", "instance_key")),
        Unique("service_installations_workspace_id_key", ("workspace_id", "id")),
    ),
    checks=(id_check("service_installations", "id", "sin"),),
    foreign_keys=(
        ForeignKey("service_installations_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        ForeignKey("service_installations_definition_fkey", ("service_definition_id",), "service_definitions",
                   ("id",)),
    ),
))

# One per installation: the author member (a `members` row of kind service) and its display projection.
service_members = introduced_in(4, Table(
    "service_members",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_installation_id", "text"),
        Column("member_id", "text"),
        Column("display_name", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    uniques=(
        Unique("service_members_installation_key", ("service_installation_id",)),
        Unique("service_members_member_key", ("member_id",)),
        Unique("service_members_workspace_id_key", ("workspace_id", "id")),
    ),
    checks=(id_check("service_members", "id", "ssm"),),
    foreign_keys=(
        tenant_fk("service_members", ("workspace_id", "service_installation_id"), "service_installations",
                  ("workspace_id", "id"), "installation"),
        member_fk("service_members", "member_id"),
    ),
))

service_grants = introduced_in(4, Table(
    "service_grants",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_installation_id", "text"),
        Column("service_capability_id", "text"),
        Column("status", "text", default="'active'"),
        Column("created_at", TS, default=NOW),
        Column("revoked_at", TS, nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("service_grants", "id", "sgr"),
        enum_check("service_grants", "status", ("active", "revoked")),
        Check("service_grants_revoked_state", "(status = 'revoked') = (revoked_at IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("service_grants", ("workspace_id", "service_installation_id"), "service_installations",
                  ("workspace_id", "id"), "installation"),
        ForeignKey("service_grants_capability_fkey", ("service_capability_id",), "service_capabilities", ("id",)),
    ),
    indexes=(Index("service_grants_live_key", "service_installation_id, service_capability_id", unique=True,
                   where="status = 'active'"),),
))

# The installation's `message.write` bound to its own message scope (§2.1).
service_target_bindings = introduced_in(4, Table(
    "service_target_bindings",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_definition_id", "text"),
        Column("service_installation_id", "text"),
        Column("service_member_id", "text"),
        Column("capability", "text"),
        Column("target_ref", "text"),
        Column("scope_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    uniques=(
        Unique("service_target_bindings_installation_capability_key", ("service_installation_id", "capability")),
        Unique("service_target_bindings_scope_key", ("scope_id",)),
    ),
    checks=(id_check("service_target_bindings", "id", "stb"),),
    foreign_keys=(
        ForeignKey("service_target_bindings_definition_fkey", ("service_definition_id",), "service_definitions",
                   ("id",)),
        tenant_fk("service_target_bindings", ("workspace_id", "service_installation_id"), "service_installations",
                  ("workspace_id", "id"), "installation"),
        tenant_fk("service_target_bindings", ("workspace_id", "service_member_id"), "service_members",
                  ("workspace_id", "id"), "service_member"),
        tenant_fk("service_target_bindings", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope"),
    ),
))

# The workspace instance (§2.5).  Audience (§3.3): `audience_policy_version` is the workspace's human
# lifecycle seq the audience must reflect; the reconciler's first pass walks the active humans by member
# id (checkpoint `audience_scan_cursor`), then applies lifecycle events after `effective_audience_version`.
service_accounts = introduced_in(4, Table(
    "service_accounts",
    columns=(
        Column("id", "text"),
        Column("principal_id", "text"),
        Column("workspace_id", "text"),
        Column("management_kind", "text", default="'workspace'"),
        Column("platform_service_account_id", "text", nullable=True),
        Column("service_installation_id", "text"),
        Column("service_member_id", "text"),
        Column("author_member_id", "text"),
        Column("message_scope_id", "text"),
        # Always 'service_account': with the composite key below the scope must be of that type.
        Column("message_scope_type", "text", default="'service_account'"),
        Column("name", "text"),
        Column("normalized_name", "text"),
        Column("description", "text", default="''"),
        Column("avatar_asset_id", "text", nullable=True),
        Column("applied_platform_profile_version", "bigint", nullable=True),
        Column("profile_version", "bigint", default="1"),
        Column("audience_policy_version", "bigint"),
        Column("effective_audience_version", "bigint", default="0"),
        Column("audience_state", "text", default="'provisioning'"),
        Column("audience_scan_complete", "boolean", default="false"),
        Column("audience_scan_cursor", "text", default="''"),
        Column("audience_batches_done", "bigint", default="0"),
        Column("version", "bigint", default="1"),
        Column("created_by_member_id", "text", nullable=True),
        Column("created_by_operator_user_id", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("service_accounts_workspace_principal_key", ("workspace_id", "principal_id")),
        Unique("service_accounts_workspace_id_key", ("workspace_id", "id")),
        Unique("service_accounts_message_scope_key", ("message_scope_id",)),
        Unique("service_accounts_installation_key", ("service_installation_id",)),
        Unique("service_accounts_service_member_key", ("service_member_id",)),
        Unique("service_accounts_author_member_key", ("author_member_id",)),
    ),
    checks=(
        id_check("service_accounts", "id", "sac"),
        enum_check("service_accounts", "management_kind", ("workspace", "platform")),
        enum_check("service_accounts", "audience_state", ("provisioning", "reconciling", "ready")),
        Check("service_accounts_workspace_principal",
              "management_kind <> 'workspace' OR (principal_id = id AND platform_service_account_id IS NULL)"),
        Check("service_accounts_scope_type", "message_scope_type = 'service_account'"),
        Check("service_accounts_name_length", "char_length(name) BETWEEN 1 AND 80"),
        Check("service_accounts_description_length", "char_length(description) <= 1000"),
        Check("service_accounts_audience_versions",
              "effective_audience_version >= 0 AND effective_audience_version <= audience_policy_version"),
        Check("service_accounts_ready_state",
              "(audience_state = 'ready') = (audience_scan_complete "
              "AND effective_audience_version = audience_policy_version)"),
        Check("service_accounts_provisioning_state",
              "(audience_state = 'provisioning') = (NOT audience_scan_complete)"),
        # A platform instance carries the platform principal (§2.5).
        Check("service_accounts_platform_principal",
              "management_kind <> 'platform' OR (platform_service_account_id IS NOT NULL "
              "AND principal_id = platform_service_account_id)", since=5),
    ),
    foreign_keys=(
        ForeignKey("service_accounts_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        tenant_fk("service_accounts", ("workspace_id", "service_installation_id"), "service_installations",
                  ("workspace_id", "id"), "installation"),
        tenant_fk("service_accounts", ("workspace_id", "service_member_id"), "service_members",
                  ("workspace_id", "id"), "service_member"),
        member_fk("service_accounts", "author_member_id"),
        tenant_fk("service_accounts", ("workspace_id", "message_scope_id", "message_scope_type"), "scopes",
                  ("workspace_id", "id", "type"), "message_scope"),
        member_fk("service_accounts", "created_by_member_id"),
        ForeignKey("service_accounts_platform_fkey", ("platform_service_account_id",), "platform_service_accounts",
                   ("id",), since=5),
    ),
    indexes=(
        Index("service_accounts_workspace_name_idx", "workspace_id, normalized_name, id"),
        Index("service_accounts_platform_idx", "platform_service_account_id", since=5,
              where="platform_service_account_id IS NOT NULL"),
        # The reconciler's queue: accounts whose audience is behind its policy.
        Index("service_accounts_audience_pending_idx", "workspace_id, id", where="audience_state <> 'ready'"),
    ),
))

service_account_managers = introduced_in(4, Table(
    "service_account_managers",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_account_id", "text"),
        Column("member_id", "text"),
        Column("status", "text", default="'active'"),
        Column("added_by_member_id", "text", nullable=True),
        Column("added_at", TS, default=NOW),
        Column("removed_at", TS, nullable=True),
        Column("removed_by_member_id", "text", nullable=True),
        Column("removed_reason", "text", nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("service_account_managers", "id", "sam"),
        enum_check("service_account_managers", "status", ("active", "removed")),
        Check("service_account_managers_removed_state",
              "(status = 'removed') = (removed_at IS NOT NULL AND removed_reason IS NOT NULL)"),
        Check("service_account_managers_removed_reason",
              "removed_reason IS NULL OR removed_reason IN ('removed', 'deactivated')"),
    ),
    foreign_keys=(
        tenant_fk("service_account_managers", ("workspace_id", "service_account_id"), "service_accounts",
                  ("workspace_id", "id"), "service_account"),
        member_fk("service_account_managers", "member_id"),
        member_fk("service_account_managers", "added_by_member_id"),
        member_fk("service_account_managers", "removed_by_member_id"),
    ),
    indexes=(
        Index("service_account_managers_active_key", "service_account_id, member_id", unique=True,
              where="status = 'active'"),
        Index("service_account_managers_member_idx", "workspace_id, member_id", where="status = 'active'"),
        Index("service_account_managers_account_idx", "service_account_id, added_at, id"),
    ),
))

service_account_create_requests = introduced_in(4, Table(
    "service_account_create_requests",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("requested_by_member_id", "text"),
        # Fixed at submit with the snapshot and its digest: the Approval subject's version.
        Column("request_version", "integer", default="1"),
        Column("client_request_id", "text"),
        Column("payload_snapshot", "jsonb"),
        Column("payload_digest", "bytea"),
        Column("authorization_path", "text"),
        Column("business_state", "text"),
        Column("approval_instance_id", "text", nullable=True),
        Column("consumed_decision_version", "integer", nullable=True),
        Column("action_required_reason", "text", nullable=True),
        Column("cancel_client_mutation_id", "text", nullable=True),
        Column("cancel_payload_digest", "bytea", nullable=True),
        Column("cancel_approval_receipt_ref", "text", nullable=True),
        Column("cancel_result_version", "integer", nullable=True),
        Column("created_service_account_id", "text", nullable=True),
        # Moves with every state change: the cancel's expected version.
        Column("version", "integer", default="1"),
        *timestamps(),
        Column("cancelled_at", TS, nullable=True),
        Column("fulfilled_at", TS, nullable=True),
    ),
    primary_key=("id",),
    uniques=(
        Unique("service_account_create_requests_client_key",
               ("workspace_id", "requested_by_member_id", "client_request_id")),
        Unique("service_account_create_requests_result_key", ("created_service_account_id",)),
    ),
    checks=(
        id_check("service_account_create_requests", "id", "sar"),
        enum_check("service_account_create_requests", "authorization_path", ("direct_create", "approval_required")),
        enum_check("service_account_create_requests", "business_state", SERVICE_ACCOUNT_BUSINESS_STATES),
        Check("service_account_create_requests_digest_length", "octet_length(payload_digest) = 32"),
        Check("service_account_create_requests_cancelled_state",
              "(business_state = 'cancelled') = (cancelled_at IS NOT NULL AND cancel_client_mutation_id IS NOT NULL)"),
        Check("service_account_create_requests_approval_path",
              "(authorization_path = 'approval_required') = (approval_instance_id IS NOT NULL)"),
        Check("service_account_create_requests_versions", "request_version >= 1 AND version >= 1"),
    ),
    foreign_keys=(
        ForeignKey("service_account_create_requests_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        member_fk("service_account_create_requests", "requested_by_member_id"),
        ForeignKey("service_account_create_requests_account_fkey", ("created_service_account_id",),
                   "service_accounts", ("id",)),
    ),
    indexes=(
        Index("service_account_create_requests_cancel_key",
              "workspace_id, requested_by_member_id, cancel_client_mutation_id", unique=True,
              where="cancel_client_mutation_id IS NOT NULL"),
        # The request lists, newest first (ids sort by creation time).
        Index("service_account_create_requests_list_idx", "workspace_id, id"),
        Index("service_account_create_requests_requester_idx", "workspace_id, requested_by_member_id, id"),
    ),
))

# The deployment-wide serialization row of a normalized name (§2.4) and a workspace's claim on it.
service_account_name_namespaces = introduced_in(4, Table(
    "service_account_name_namespaces",
    columns=(
        Column("normalized_name", "text"),
        # A platform account's ownership: exclusive with workspace claims (§2.4).
        Column("platform_service_account_id", "text", nullable=True),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("normalized_name",),
    uniques=(Unique("service_account_name_namespaces_platform_key", ("platform_service_account_id",), since=5),),
    foreign_keys=(ForeignKey("service_account_name_namespaces_platform_fkey", ("platform_service_account_id",),
                             "platform_service_accounts", ("id",), since=5),),
))

service_account_name_claims = introduced_in(4, Table(
    "service_account_name_claims",
    columns=(
        Column("workspace_id", "text"),
        Column("normalized_name", "text"),
        Column("service_account_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("workspace_id", "normalized_name"),
    uniques=(Unique("service_account_name_claims_account_key", ("service_account_id",)),),
    foreign_keys=(
        ForeignKey("service_account_name_claims_namespace_fkey", ("normalized_name",),
                   "service_account_name_namespaces", ("normalized_name",)),
        tenant_fk("service_account_name_claims", ("workspace_id", "service_account_id"), "service_accounts",
                  ("workspace_id", "id"), "service_account"),
    ),
))

# Every governance, authorization and execution fact (§1.2.11, §8.2), written in the mutation's
# transaction.  The account reference is cleared when the account is deleted; subject id/version stay.
service_account_audit_events = introduced_in(4, Table(
    "service_account_audit_events",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("service_account_id", "text", nullable=True),
        Column("subject_type", "text"),
        Column("subject_id", "text"),
        Column("subject_version", "bigint", nullable=True),
        Column("action", "text"),
        Column("actor_type", "text"),
        Column("actor_member_id", "text", nullable=True),
        Column("permission_basis", "text"),
        Column("caused_by_member_id", "text", nullable=True),
        Column("execution_member_id", "text", nullable=True),
        Column("durable_author_member_id", "text", nullable=True),
        Column("byline_member_id", "text", nullable=True),
        Column("message_id", "text", nullable=True),
        Column("message_version", "integer", nullable=True),
        Column("correlation_id", "text"),
        Column("before_digest", "text", nullable=True),
        Column("after_digest", "text", nullable=True),
        Column("comment", "text", nullable=True),
        Column("details", "jsonb", default="'{}'::jsonb"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    checks=(
        id_check("service_account_audit_events", "id", "sae"),
        enum_check("service_account_audit_events", "subject_type",
                   ("service_account", "create_request", "approval", "message", "policy")),
        enum_check("service_account_audit_events", "actor_type", ("human", "service", "system")),
    ),
    foreign_keys=(
        ForeignKey("service_account_audit_events_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        ForeignKey("service_account_audit_events_account_fkey", ("service_account_id",), "service_accounts",
                   ("id",), on_delete="SET NULL"),
    ),
    indexes=(
        Index("service_account_audit_events_list_idx", "workspace_id, id"),
        Index("service_account_audit_events_account_idx", "service_account_id, id",
              where="service_account_id IS NOT NULL"),
    ),
))

# Per workspace: the creation policy (§2.3) and the counter of human lifecycle events (§3.3).
service_account_workspace_policies = introduced_in(4, Table(
    "service_account_workspace_policies",
    columns=(
        Column("workspace_id", "text"),
        Column("creation_policy", "text", default="'approval_required'"),
        Column("version", "bigint", default="0"),
        Column("human_lifecycle_seq", "bigint", default="0"),
        Column("updated_by_member_id", "text", nullable=True),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id",),
    checks=(enum_check("service_account_workspace_policies", "creation_policy",
                       ("approval_required", "direct_create", "admins_only")),),
    foreign_keys=(ForeignKey("service_account_workspace_policies_workspace_fkey", ("workspace_id",), "workspaces",
                             ("id",)),),
))

# A human became active (joined, re-joined) or inactive (removed) in the workspace: what an audience
# reconcile applies after its first pass, so a lifecycle change costs O(changed members).
workspace_human_lifecycle_events = introduced_in(4, Table(
    "workspace_human_lifecycle_events",
    columns=(
        Column("workspace_id", "text"),
        Column("lifecycle_seq", "bigint"),
        Column("member_id", "text"),
        Column("action", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("workspace_id", "lifecycle_seq"),
    checks=(enum_check("workspace_human_lifecycle_events", "action", ("activated", "deactivated")),),
    foreign_keys=(member_fk("workspace_human_lifecycle_events", "member_id"),),
))

# The Approval domain (§2.3): one instance per create request, versioned.
approval_instances = introduced_in(4, Table(
    "approval_instances",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("subject_type", "text"),
        Column("subject_ref", "text"),
        Column("subject_version", "integer"),
        Column("payload_digest", "bytea"),
        Column("state", "text", default="'pending'"),
        Column("version", "integer", default="1"),
        Column("decided_by_member_id", "text", nullable=True),
        Column("decision_reason", "text", nullable=True),
        Column("decided_at", TS, nullable=True),
        Column("closed_by_mutation_id", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(Unique("approval_instances_subject_key", ("subject_type", "subject_ref", "subject_version")),),
    checks=(
        id_check("approval_instances", "id", "apv"),
        enum_check("approval_instances", "subject_type", ("service_account_create_request",)),
        enum_check("approval_instances", "state", ("pending", "approved", "rejected", "closed")),
        Check("approval_instances_decided_state",
              "(state IN ('approved', 'rejected')) = (decided_at IS NOT NULL AND decided_by_member_id IS NOT NULL)"),
        Check("approval_instances_closed_state", "(state = 'closed') = (closed_by_mutation_id IS NOT NULL)"),
    ),
    foreign_keys=(
        ForeignKey("approval_instances_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        member_fk("approval_instances", "decided_by_member_id"),
    ),
))

# The App Notification intents an approval's events produce (submitted, decided, closed): written with
# the change, projected after commit into cards, receipts and results, idempotently (a crash replays).
approval_notification_intents = introduced_in(4, Table(
    "approval_notification_intents",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("approval_instance_id", "text"),
        Column("kind", "text"),
        Column("approval_version", "integer"),
        Column("status", "text", default="'pending'"),
        Column("attempts", "integer", default="0"),
        Column("last_error", "text", nullable=True),
        Column("created_at", TS, default=NOW),
        Column("done_at", TS, nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("approval_notification_intents", "id", "ani"),
        enum_check("approval_notification_intents", "kind", ("submitted", "decided", "closed")),
        enum_check("approval_notification_intents", "status", ("pending", "done")),
        Check("approval_notification_intents_done_state", "(status = 'done') = (done_at IS NOT NULL)"),
    ),
    foreign_keys=(ForeignKey("approval_notification_intents_approval_fkey", ("approval_instance_id",),
                             "approval_instances", ("id",)),),
    indexes=(
        Index("approval_notification_intents_pending_idx", "created_at", where="status = 'pending'"),
        Index("approval_notification_intents_approval_idx", "approval_instance_id, created_at",
              where="status = 'pending'"),
    ),
))

# The sidecar of an app card message (scope-model §4.2): its stable notification identity, the business
# object it shows, and `card_revision` (the mutation key of its updates).
service_notification_cards = introduced_in(4, Table(
    "service_notification_cards",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("notification_key", "text"),
        Column("role", "text"),
        Column("recipient_member_id", "text"),
        Column("business_object_type", "text", default="'approval_instance'"),
        Column("business_object_id", "text"),
        Column("expected_approval_version", "integer"),
        Column("card_revision", "integer", default="1"),
        Column("scope_id", "text"),
        Column("message_id", "text"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(Unique("service_notification_cards_notification_key", ("notification_key",)),),
    checks=(
        id_check("service_notification_cards", "id", "snc"),
        enum_check("service_notification_cards", "role", ("reviewer", "receipt", "result")),
        Check("service_notification_cards_revision", "card_revision >= 1"),
    ),
    foreign_keys=(
        member_fk("service_notification_cards", "recipient_member_id"),
        tenant_fk("service_notification_cards", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message"),
        ForeignKey("service_notification_cards_approval_fkey", ("business_object_id",), "approval_instances",
                   ("id",)),
    ),
    indexes=(Index("service_notification_cards_object_idx", "business_object_id"),),
))

# Shared message pins and the top notice of a scope (Message Pin contract; managed by the account's managers).
scope_message_pins = introduced_in(4, Table(
    "scope_message_pins",
    columns=(
        Column("scope_id", "text"),
        Column("message_id", "text"),
        Column("workspace_id", "text"),
        Column("is_top_notice", "boolean", default="false"),
        Column("pinned_by_member_id", "text"),
        Column("pinned_at", TS, default=NOW),
    ),
    primary_key=("scope_id", "message_id"),
    foreign_keys=(
        tenant_fk("scope_message_pins", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"), "message"),
        member_fk("scope_message_pins", "pinned_by_member_id"),
    ),
    indexes=(Index("scope_message_pins_top_notice_key", "scope_id", unique=True, where="is_top_notice"),),
))

# --- platform service accounts and broadcast (service-account.md §2.4, §4.5, §7) ------------------------

# A platform operator: a principal of the deployment, not a member of any workspace.
platform_operators = introduced_in(5, Table(
    "platform_operators",
    columns=(
        Column("id", "text"),
        Column("name", "text"),
        Column("status", "text", default="'active'"),
        Column("created_at", TS, default=NOW),
        Column("disabled_at", TS, nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("platform_operators", "id", "pop"),
        enum_check("platform_operators", "status", ("active", "disabled")),
        Check("platform_operators_disabled_state", "(status = 'disabled') = (disabled_at IS NOT NULL)"),
        Check("platform_operators_name_length", "char_length(name) BETWEEN 1 AND 200"),
    ),
))

platform_operator_keys = introduced_in(5, Table(
    "platform_operator_keys",
    columns=(
        Column("id", "text"),
        Column("operator_id", "text"),
        Column("name", "text"),
        Column("key_hash", "bytea"),
        Column("status", "text", default="'active'"),
        Column("created_at", TS, default=NOW),
        Column("revoked_at", TS, nullable=True),
    ),
    primary_key=("id",),
    uniques=(Unique("platform_operator_keys_key_hash_key", ("key_hash",)),),
    checks=(
        id_check("platform_operator_keys", "id", "pok"),
        enum_check("platform_operator_keys", "status", ("active", "revoked")),
        Check("platform_operator_keys_key_hash_length", "octet_length(key_hash) = 32"),
        Check("platform_operator_keys_revoked_state", "(status = 'revoked') = (revoked_at IS NOT NULL)"),
    ),
    foreign_keys=(ForeignKey("platform_operator_keys_operator_fkey", ("operator_id",), "platform_operators",
                             ("id",)),),
    indexes=(Index("platform_operator_keys_operator_idx", "operator_id"),),
))

# The platform principal and management authority (§2.4).  Its row is the root lock: acceptance ordinals,
# broadcast seqs, instance intervals and delivery leases are written under it, and Delete takes it.
platform_service_accounts = introduced_in(5, Table(
    "platform_service_accounts",
    columns=(
        Column("id", "text"),
        Column("name", "text"),
        Column("normalized_name", "text"),
        Column("description", "text", default="''"),
        Column("avatar_asset_id", "text", nullable=True),
        Column("profile_version", "bigint", default="1"),
        Column("version", "bigint", default="1"),
        Column("provisioning_mode", "text", default="'all_workspaces'"),
        Column("provisioning_state", "text", default="'provisioning'"),
        Column("created_provisioning_generation", "bigint"),
        # The deployment generation the current provisioning pass drives to, and its workspace-id cursor.
        Column("target_provisioning_generation", "bigint"),
        Column("provisioning_cursor", "text", default="''"),
        Column("provisioning_scan_complete", "boolean", default="false"),
        Column("applied_provisioning_generation", "bigint", default="0"),
        Column("audience_policy_version", "bigint", default="1"),
        Column("latest_broadcast_seq", "bigint", default="0"),
        Column("latest_acceptance_ordinal", "bigint", default="0"),
        Column("created_by_operator_id", "text"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(Unique("platform_service_accounts_normalized_name_key", ("normalized_name",)),),
    checks=(
        id_check("platform_service_accounts", "id", "psa"),
        enum_check("platform_service_accounts", "provisioning_mode", ("all_workspaces",)),
        enum_check("platform_service_accounts", "provisioning_state", ("provisioning", "ready")),
        Check("platform_service_accounts_name_length", "char_length(name) BETWEEN 1 AND 80"),
        Check("platform_service_accounts_description_length", "char_length(description) <= 1000"),
        Check("platform_service_accounts_generations",
              "applied_provisioning_generation <= target_provisioning_generation "
              "AND created_provisioning_generation <= target_provisioning_generation"),
        Check("platform_service_accounts_ready_state",
              "(provisioning_state = 'ready') = (applied_provisioning_generation = target_provisioning_generation)"),
        Check("platform_service_accounts_counters",
              "latest_broadcast_seq >= 0 AND latest_acceptance_ordinal >= latest_broadcast_seq "
              "AND profile_version >= 1 AND version >= 1"),
    ),
    foreign_keys=(ForeignKey("platform_service_accounts_operator_fkey", ("created_by_operator_id",),
                             "platform_operators", ("id",)),),
))

# The durable cross-product inputs (§2.4): one row per generation.
platform_service_account_provisioning_inputs = introduced_in(5, Table(
    "platform_service_account_provisioning_inputs",
    columns=(
        Column("generation", "bigint"),
        Column("input_kind", "text"),
        Column("platform_service_account_id", "text", nullable=True),
        Column("workspace_id", "text", nullable=True),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("generation",),
    uniques=(Unique("platform_service_account_provisioning_inputs_workspace_key", ("workspace_id",)),),
    checks=(
        enum_check("platform_service_account_provisioning_inputs", "input_kind",
                   ("platform_account_created", "workspace_created")),
        Check("platform_service_account_provisioning_inputs_subject",
              "(input_kind = 'workspace_created' AND workspace_id IS NOT NULL "
              "AND platform_service_account_id IS NULL) OR (input_kind = 'platform_account_created' "
              "AND platform_service_account_id IS NOT NULL AND workspace_id IS NULL)"),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_provisioning_inputs_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_provisioning_inputs_workspace_fkey", ("workspace_id",), "workspaces",
                   ("id",)),
    ),
    indexes=(Index("platform_service_account_provisioning_inputs_account_idx", "platform_service_account_id",
                   where="platform_service_account_id IS NOT NULL"),),
))

# A workspace's instance of a platform account: the broadcast-seq interval it receives and its delivery cursor.
platform_service_account_workspace_instances = introduced_in(5, Table(
    "platform_service_account_workspace_instances",
    columns=(
        Column("id", "text"),
        Column("platform_service_account_id", "text"),
        Column("workspace_id", "text"),
        Column("local_service_account_id", "text"),
        Column("opened_provisioning_generation", "bigint"),
        Column("effective_from_broadcast_seq", "bigint"),
        Column("effective_to_broadcast_seq", "bigint", nullable=True),
        Column("last_applied_broadcast_seq", "bigint"),
        Column("applied_profile_version", "bigint"),
        Column("provisioning_state", "text", default="'identity_ready'"),
        Column("version", "bigint", default="1"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("platform_service_account_workspace_instances_pair_key",
               ("platform_service_account_id", "workspace_id")),
        Unique("platform_service_account_workspace_instances_local_key", ("local_service_account_id",)),
    ),
    checks=(
        id_check("platform_service_account_workspace_instances", "id", "psi"),
        enum_check("platform_service_account_workspace_instances", "provisioning_state",
                   ("identity_ready", "ready")),
        Check("platform_service_account_workspace_instances_interval",
              "effective_from_broadcast_seq >= 1 AND last_applied_broadcast_seq >= effective_from_broadcast_seq - 1 "
              "AND (effective_to_broadcast_seq IS NULL OR effective_to_broadcast_seq >= effective_from_broadcast_seq)"),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_workspace_instances_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_workspace_instances_workspace_fkey", ("workspace_id",), "workspaces",
                   ("id",)),
        tenant_fk("platform_service_account_workspace_instances", ("workspace_id", "local_service_account_id"),
                  "service_accounts", ("workspace_id", "id"), "local_account"),
    ),
    indexes=(Index("platform_service_account_workspace_instances_pending_idx", "platform_service_account_id",
                   where="provisioning_state <> 'ready'"),),
))

# One broadcast: the immutable MessagePlan snapshot, its fences and its aggregate state (§4.5).
platform_service_account_broadcasts = introduced_in(5, Table(
    "platform_service_account_broadcasts",
    columns=(
        Column("id", "text"),
        Column("platform_service_account_id", "text"),
        Column("operator_id", "text"),
        Column("client_broadcast_id", "text"),
        Column("payload_digest", "bytea"),
        Column("title", "text"),
        Column("content", "text"),
        Column("message_type", "text", default="'service_account_post'"),
        Column("correlation_id", "text"),
        Column("required_provisioning_generation", "bigint"),
        Column("acceptance_ordinal", "bigint"),
        Column("broadcast_seq", "bigint", nullable=True),
        Column("state", "text", default="'waiting_provisioning'"),
        Column("enumeration_cursor", "text", default="''"),
        Column("enumeration_complete", "boolean", default="false"),
        Column("version", "bigint", default="1"),
        Column("created_at", TS, default=NOW),
        Column("sequenced_at", TS, nullable=True),
        Column("completed_at", TS, nullable=True),
        Column("updated_at", TS, default=NOW),
        # The immutable asset manifest (in order: asset id, sha256, type, size, filename, label),
        # frozen at acceptance and covered by payload_digest.
        Column("asset_manifest", "jsonb", default="'[]'::jsonb", since=10),
    ),
    primary_key=("id",),
    uniques=(
        Unique("platform_service_account_broadcasts_ordinal_key", ("platform_service_account_id",
                                                                   "acceptance_ordinal")),
        Unique("platform_service_account_broadcasts_seq_key", ("platform_service_account_id", "broadcast_seq")),
        Unique("platform_service_account_broadcasts_client_key", ("platform_service_account_id", "operator_id",
                                                                  "client_broadcast_id")),
    ),
    checks=(
        id_check("platform_service_account_broadcasts", "id", "pbc"),
        enum_check("platform_service_account_broadcasts", "state",
                   ("waiting_provisioning", "accepted", "dispatching", "completed", "completed_with_exceptions",
                    "closed")),
        Check("platform_service_account_broadcasts_sequenced",
              "(broadcast_seq IS NULL) = (state = 'waiting_provisioning') "
              "AND (broadcast_seq IS NULL) = (sequenced_at IS NULL)"),
        Check("platform_service_account_broadcasts_completed",
              "(completed_at IS NOT NULL) = (state IN ('completed', 'completed_with_exceptions', 'closed'))"),
        Check("platform_service_account_broadcasts_enumerated",
              "enumeration_complete OR state IN ('waiting_provisioning', 'accepted')"),
        Check("platform_service_account_broadcasts_digest_length", "octet_length(payload_digest) = 32"),
        Check("platform_service_account_broadcasts_manifest_array", "jsonb_typeof(asset_manifest) = 'array'",
              since=10),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_broadcasts_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_broadcasts_operator_fkey", ("operator_id",), "platform_operators",
                   ("id",)),
    ),
    indexes=(
        # The allocator's head of line: the lowest unsequenced ordinal.
        Index("platform_service_account_broadcasts_waiting_idx", "platform_service_account_id, acceptance_ordinal",
              where="broadcast_seq IS NULL"),
        Index("platform_service_account_broadcasts_open_idx", "platform_service_account_id, broadcast_seq",
              where="state IN ('accepted', 'dispatching')"),
    ),
))

# Per-workspace targets of a broadcast and their execution fence (§4.5): lease token, expiry, placement epoch.
platform_service_account_broadcast_deliveries = introduced_in(5, Table(
    "platform_service_account_broadcast_deliveries",
    columns=(
        Column("id", "text"),
        Column("broadcast_id", "text"),
        Column("platform_service_account_id", "text"),
        Column("workspace_id", "text"),
        Column("local_service_account_id", "text"),
        Column("local_scope_id", "text"),
        Column("broadcast_seq", "bigint"),
        Column("recipient_eligible", "boolean"),
        Column("state", "text", default="'queued'"),
        Column("outcome", "text", nullable=True),
        Column("attempt", "integer", default="0"),
        Column("lease_token", "text", nullable=True),
        Column("lease_expires_at", TS, nullable=True),
        Column("placement_epoch", "bigint", nullable=True),
        Column("next_attempt_at", TS, default=NOW),
        Column("local_message_id", "text", nullable=True),
        Column("last_error", "text", nullable=True),
        Column("version", "bigint", default="1"),
        *timestamps(),
    ),
    primary_key=("id",),
    uniques=(
        Unique("platform_service_account_broadcast_deliveries_target_key", ("broadcast_id", "workspace_id")),
        Unique("platform_service_account_broadcast_deliveries_order_key",
               ("platform_service_account_id", "workspace_id", "broadcast_seq")),
    ),
    checks=(
        id_check("platform_service_account_broadcast_deliveries", "id", "pbd"),
        enum_check("platform_service_account_broadcast_deliveries", "state",
                   ("queued", "leased", "waiting_instance", "waiting_audience", "retry_wait", "operator_attention",
                    "delivered", "closed", "skipped")),
        Check("platform_service_account_broadcast_deliveries_outcome",
              "(outcome IS NULL) = (state NOT IN ('delivered', 'closed', 'skipped')) AND (outcome IS NULL "
              "OR (state = 'delivered' AND outcome = 'delivered' AND local_message_id IS NOT NULL) "
              "OR (state = 'closed' AND outcome = 'generation_excluded' AND NOT recipient_eligible) "
              "OR (state = 'skipped' AND outcome = 'skipped'))"),
        Check("platform_service_account_broadcast_deliveries_lease",
              "(state = 'leased') = (lease_token IS NOT NULL) "
              "AND (lease_token IS NULL) = (lease_expires_at IS NULL)"),
        Check("platform_service_account_broadcast_deliveries_excluded",
              "recipient_eligible OR local_message_id IS NULL"),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_broadcast_deliveries_broadcast_fkey", ("broadcast_id",),
                   "platform_service_account_broadcasts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_broadcast_deliveries_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_broadcast_deliveries_workspace_fkey", ("workspace_id",), "workspaces",
                   ("id",)),
    ),
    indexes=(
        # The dispatcher's per-workspace heads: unsettled rows in seq order.
        Index("platform_service_account_broadcast_deliveries_unsettled_idx",
              "platform_service_account_id, workspace_id, broadcast_seq",
              where="state NOT IN ('delivered', 'closed', 'skipped')"),
        Index("platform_service_account_broadcast_deliveries_broadcast_idx", "broadcast_id, state"),
    ),
))

# Which node serves a workspace, with the epoch that fences work a former owner leased (§4.5).
workspace_placements = introduced_in(5, Table(
    "workspace_placements",
    columns=(
        Column("workspace_id", "text"),
        Column("node_id", "text"),
        Column("placement_epoch", "bigint", default="1"),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id",),
    checks=(Check("workspace_placements_epoch_positive", "placement_epoch >= 1"),),
    foreign_keys=(ForeignKey("workspace_placements_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),),
))

# Content the moderation boundary refused (scope-model §3.6.1): a security fact for the operators' review,
# kept when the account is deleted (no foreign keys).
platform_moderation_logs = introduced_in(5, Table(
    "platform_moderation_logs",
    columns=(
        Column("id", "text"),
        Column("target_type", "text"),
        Column("platform_service_account_id", "text", nullable=True),
        Column("operator_id", "text", nullable=True),
        Column("client_broadcast_id", "text", nullable=True),
        Column("title", "text"),
        Column("content", "text"),
        Column("matched_keywords", "text[]"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    checks=(
        id_check("platform_moderation_logs", "id", "pml"),
        enum_check("platform_moderation_logs", "target_type", ("platform_broadcast",)),
    ),
    indexes=(Index("platform_moderation_logs_created_idx", "created_at"),),
))

platform_service_account_audit_events = introduced_in(5, Table(
    "platform_service_account_audit_events",
    columns=(
        Column("id", "text"),
        Column("platform_service_account_id", "text", nullable=True),
        Column("subject_type", "text"),
        Column("subject_id", "text"),
        Column("subject_version", "bigint", nullable=True),
        Column("action", "text"),
        Column("operator_id", "text", nullable=True),
        Column("permission_basis", "text"),
        Column("correlation_id", "text"),
        Column("broadcast_id", "text", nullable=True),
        Column("broadcast_seq", "bigint", nullable=True),
        Column("details", "jsonb", default="'{}'::jsonb"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    checks=(
        id_check("platform_service_account_audit_events", "id", "pae"),
        enum_check("platform_service_account_audit_events", "subject_type",
                   ("platform_service_account", "broadcast", "delivery", "instance")),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_audit_events_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="SET NULL"),
        ForeignKey("platform_service_account_audit_events_operator_fkey", ("operator_id",), "platform_operators",
                   ("id",)),
    ),
    indexes=(
        # One account's audit, also after its deletion (the id stays in details when the key is nulled).
        Index("platform_service_account_audit_events_account_idx",
              "(details ->> 'platform_service_account_id'), id"),
    ),
))

# --- strands (strand-message.md §2-§9; collaborator-policy §4.2.1): boards, task scopes' strand rows,
# --- assignments, watches, the default strand, audience-mention policy and grants, agent participation.

STRAND_STAGES = ("draft", "proposed", "planned", "in_progress", "blocked", "done", "cancelled", "superseded")
WATCH_LEVELS = ("mentions_only", "participating", "all", "muted")
AUDIENCE_KINDS = ("effective_scope_members", "strand_participants", "strand_watchers", "strand_engaged",
                  "assigned_actors")

# A board bound to one channel: the authority of every task on it (§4.2.1).
task_boards = introduced_in(6, Table(
    "task_boards",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("channel_id", "text"),
        Column("scope_type", "text", default="'channel'"),
        Column("name", "text"),
        Column("status", "text", default="'active'"),
        Column("created_by_member_id", "text"),
        *timestamps(),
        Column("archived_at", TS, nullable=True),
    ),
    primary_key=("id",),
    uniques=(
        Unique("task_boards_workspace_id_key", ("workspace_id", "id")),
        Unique("task_boards_workspace_channel_id_key", ("workspace_id", "channel_id", "id")),
    ),
    checks=(
        id_check("task_boards", "id", "tbd"),
        Check("task_boards_scope_type_channel", "scope_type = 'channel'"),
        Check("task_boards_name_length", "char_length(name) BETWEEN 1 AND 200"),
        enum_check("task_boards", "status", ("active", "archived")),
        Check("task_boards_archived_state", "(status = 'archived') = (archived_at IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("task_boards", ("workspace_id", "channel_id", "scope_type"), "scopes", ("workspace_id", "id", "type"),
                  "channel"),
        member_fk("task_boards", "created_by_member_id"),
    ),
    indexes=(Index("task_boards_channel_idx", "channel_id, status"),
             Index("task_boards_channel_name_key", "channel_id, lower(name)", unique=True)),
))

# A task scope's strand (§3): id = the task scope's id.  `channel_id` is the board's
# channel, denormalized as the seed's tasks.channel_id: a mismatch with the board
# reads as no access (fail closed), never as the other channel's.
strands = introduced_in(6, Table(
    "strands",
    columns=(
        Column("scope_id", "text"),
        Column("workspace_id", "text"),
        Column("scope_type", "text", default="'task'"),
        Column("board_id", "text"),
        Column("channel_id", "text"),
        Column("title", "text"),
        Column("summary", "text", nullable=True),
        Column("fields", "jsonb", default="'{}'::jsonb"),
        Column("content", "text", default="''"),
        Column("tracks", "jsonb"),
        Column("synthesis_content", "text", nullable=True),
        Column("synthesis_revision", "integer", default="0"),
        Column("state", "text", default="'active'"),
        Column("state_changed_at", TS, nullable=True),
        Column("stage", "text", nullable=True),
        Column("stage_changed_at", TS, nullable=True),
        # The governance ceiling on agents here (§3 agent_participation); NULL inherits.
        Column("accept_third_party_mention", "boolean", nullable=True),
        Column("version", "integer", default="1"),
        Column("client_strand_id", "text", nullable=True),
        Column("created_by_member_id", "text"),
        Column("updated_by_member_id", "text", nullable=True),
        *timestamps(),
    ),
    primary_key=("scope_id",),
    uniques=(
        Unique("strands_workspace_id_key", ("workspace_id", "scope_id")),
        Unique("strands_client_id_key", ("workspace_id", "created_by_member_id", "client_strand_id")),
    ),
    checks=(
        Check("strands_scope_type_task", "scope_type = 'task'"),
        Check("strands_title_length", "char_length(title) BETWEEN 1 AND 512"),
        Check("strands_summary_length", "summary IS NULL OR char_length(summary) <= 2048"),
        Check("strands_content_length", "char_length(content) <= 40000"),
        Check("strands_synthesis_length", "synthesis_content IS NULL OR char_length(synthesis_content) <= 40000"),
        Check("strands_fields_object", "jsonb_typeof(fields) = 'object'"),
        Check("strands_tracks_object", "jsonb_typeof(tracks) = 'object' AND tracks <> '{}'::jsonb"),
        enum_check("strands", "state", ("active", "archived")),
        Check("strands_state_changed", "state = 'active' OR state_changed_at IS NOT NULL"),
        Check("strands_stage_valid", "stage IS NULL OR stage IN (" + ", ".join(f"'{v}'" for v in STRAND_STAGES) + ")"),
        Check("strands_stage_changed", "(stage IS NULL) = (stage_changed_at IS NULL)"),
        Check("strands_counters", "version >= 1 AND synthesis_revision >= 0"),
        Check("strands_client_strand_id_length", "char_length(client_strand_id) BETWEEN 1 AND 128"),
    ),
    foreign_keys=(
        tenant_fk("strands", ("workspace_id", "scope_id", "scope_type"), "scopes", ("workspace_id", "id", "type"),
                  "scope"),
        tenant_fk("strands", ("workspace_id", "channel_id", "board_id"), "task_boards",
                  ("workspace_id", "channel_id", "id"), "board"),
        member_fk("strands", "created_by_member_id"),
        member_fk("strands", "updated_by_member_id"),
    ),
    indexes=(Index("strands_board_idx", "board_id, state, updated_at"),),
))

# Every synthesis revision is kept (§4.2); the strand row holds the canonical one.
strand_synthesis_revisions = introduced_in(6, Table(
    "strand_synthesis_revisions",
    columns=(
        Column("scope_id", "text"),
        Column("revision", "integer"),
        Column("workspace_id", "text"),
        Column("content", "text"),
        Column("edited_by_member_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("scope_id", "revision"),
    checks=(Check("strand_synthesis_revisions_revision_positive", "revision >= 1"),
            Check("strand_synthesis_revisions_content_length", "char_length(content) <= 40000")),
    foreign_keys=(
        tenant_fk("strand_synthesis_revisions", ("workspace_id", "scope_id"), "strands", ("workspace_id", "scope_id"),
                  "strand"),
        member_fk("strand_synthesis_revisions", "edited_by_member_id"),
    ),
))

# strand --assigned_to--> member (§7.1): a relation, tombstoned to unassign; never a strand field.
strand_assignments = introduced_in(6, Table(
    "strand_assignments",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("member_id", "text"),
        Column("state", "text", default="'active'"),
        Column("assigned_by_member_id", "text"),
        Column("created_at", TS, default=NOW),
        Column("removed_by_member_id", "text", nullable=True),
        Column("removed_at", TS, nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("strand_assignments", "id", "asg"),
        enum_check("strand_assignments", "state", ("active", "tombstoned")),
        Check("strand_assignments_tombstone_state",
              "(state = 'tombstoned') = (removed_at IS NOT NULL AND removed_by_member_id IS NOT NULL)"),
    ),
    foreign_keys=(
        tenant_fk("strand_assignments", ("workspace_id", "scope_id"), "strands", ("workspace_id", "scope_id"),
                  "strand"),
        member_fk("strand_assignments", "member_id"),
        member_fk("strand_assignments", "assigned_by_member_id"),
        member_fk("strand_assignments", "removed_by_member_id"),
    ),
    indexes=(
        Index("strand_assignments_active_key", "scope_id, member_id", unique=True, where="state = 'active'"),
        Index("strand_assignments_member_idx", "workspace_id, member_id", where="state = 'active'"),
    ),
))

# The strand_watch typed current result (§8.3): one row per (strand, watcher) once written;
# level NULL is a written-then-cleared value (mentions_only), distinct from never written.
strand_watches = introduced_in(6, Table(
    "strand_watches",
    columns=(
        Column("scope_id", "text"),
        Column("watcher_member_id", "text"),
        Column("workspace_id", "text"),
        Column("level", "text", nullable=True),
        Column("level_public", "boolean", nullable=True),
        Column("revision", "integer", default="1"),
        Column("written_by_member_id", "text"),
        *timestamps(),
    ),
    primary_key=("scope_id", "watcher_member_id"),
    checks=(
        Check("strand_watches_level_valid",
              "level IS NULL OR level IN (" + ", ".join(f"'{v}'" for v in WATCH_LEVELS) + ")"),
        Check("strand_watches_public_needs_level", "level IS NOT NULL OR level_public IS NULL"),
        Check("strand_watches_revision_positive", "revision >= 1"),
    ),
    foreign_keys=(
        tenant_fk("strand_watches", ("workspace_id", "scope_id"), "strands", ("workspace_id", "scope_id"), "strand"),
        member_fk("strand_watches", "watcher_member_id"),
        member_fk("strand_watches", "written_by_member_id"),
    ),
    indexes=(Index("strand_watches_member_idx", "workspace_id, watcher_member_id"),),
))

# Who changed what on a strand: stage, tracks, lifecycle, assignments, another's watch
# (watch_set_others, §8.4) and full watch reads (watch_audit_read, §8.5).
strand_audit_events = introduced_in(6, Table(
    "strand_audit_events",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("actor_member_id", "text"),
        Column("action", "text"),
        Column("target_member_id", "text", nullable=True),
        Column("details", "jsonb", default="'{}'::jsonb"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("id",),
    checks=(
        id_check("strand_audit_events", "id", "sau"),
        enum_check("strand_audit_events", "action",
                   ("create", "update", "tracks_update", "stage_set", "archive", "restore", "assign", "unassign",
                    "watch_set_others", "watch_audit_read", "default_set")),
        Check("strand_audit_events_details_object", "jsonb_typeof(details) = 'object'"),
    ),
    foreign_keys=(
        tenant_fk("strand_audit_events", ("workspace_id", "scope_id"), "strands", ("workspace_id", "scope_id"),
                  "strand"),
        member_fk("strand_audit_events", "actor_member_id"),
        member_fk("strand_audit_events", "target_member_id"),
    ),
    indexes=(Index("strand_audit_events_strand_idx", "scope_id, created_at"),),
))

# The workspace's default discussion strand (§2.1): one pointer, whole-value compare-and-set.
workspace_default_strands = introduced_in(6, Table(
    "workspace_default_strands",
    columns=(
        Column("workspace_id", "text"),
        Column("default_strand_id", "text", nullable=True),
        Column("revision", "integer", default="1"),
        Column("updated_by_member_id", "text"),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id",),
    checks=(Check("workspace_default_strands_revision_positive", "revision >= 1"),),
    foreign_keys=(
        ForeignKey("workspace_default_strands_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        tenant_fk("workspace_default_strands", ("workspace_id", "default_strand_id"), "strands",
                  ("workspace_id", "scope_id"), "strand"),
        member_fk("workspace_default_strands", "updated_by_member_id"),
    ),
))

# The workspace's declared audience-mention policy (§9.4.4), per audience; no row = disabled.
audience_mention_policies = introduced_in(6, Table(
    "audience_mention_policies",
    columns=(
        Column("workspace_id", "text"),
        Column("audience", "text"),
        Column("max_recipients", "integer"),
        Column("updated_by_member_id", "text"),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id", "audience"),
    checks=(
        enum_check("audience_mention_policies", "audience", AUDIENCE_KINDS),
        Check("audience_mention_policies_max_recipients", "max_recipients BETWEEN 1 AND 100000"),
    ),
    foreign_keys=(
        ForeignKey("audience_mention_policies_workspace_fkey", ("workspace_id",), "workspaces", ("id",)),
        member_fk("audience_mention_policies", "updated_by_member_id"),
    ),
))

# ak.message.mention.broadcast (§9.4.4): a high-risk grant, always with an expiry, a
# channel selector (the channel, its threads and its boards' tasks) and a rate quota.
audience_mention_grants = introduced_in(6, Table(
    "audience_mention_grants",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("member_id", "text"),
        Column("channel_id", "text"),
        Column("scope_type", "text", default="'channel'"),
        Column("max_operations", "integer"),
        Column("period_seconds", "integer"),
        Column("granted_by_member_id", "text"),
        Column("created_at", TS, default=NOW),
        Column("expires_at", TS),
        Column("revoked_at", TS, nullable=True),
        Column("revoked_by_member_id", "text", nullable=True),
    ),
    primary_key=("id",),
    checks=(
        id_check("audience_mention_grants", "id", "amg"),
        Check("audience_mention_grants_scope_type_channel", "scope_type = 'channel'"),
        Check("audience_mention_grants_quota", "max_operations BETWEEN 1 AND 10000 "
              "AND period_seconds BETWEEN 1 AND 31536000"),
        Check("audience_mention_grants_expiry", "expires_at > created_at"),
        Check("audience_mention_grants_revoked_state", "(revoked_at IS NULL) = (revoked_by_member_id IS NULL)"),
    ),
    foreign_keys=(
        tenant_fk("audience_mention_grants", ("workspace_id", "channel_id", "scope_type"), "scopes",
                  ("workspace_id", "id", "type"), "channel"),
        member_fk("audience_mention_grants", "member_id"),
        member_fk("audience_mention_grants", "granted_by_member_id"),
        member_fk("audience_mention_grants", "revoked_by_member_id"),
    ),
    indexes=(Index("audience_mention_grants_member_idx", "workspace_id, member_id, channel_id",
                   where="revoked_at IS NULL"),),
))

# One row per message that used a grant: the quota counts them in its period.
audience_mention_uses = introduced_in(6, Table(
    "audience_mention_uses",
    columns=(
        Column("grant_id", "text"),
        Column("message_id", "text"),
        Column("workspace_id", "text"),
        Column("used_at", TS),
    ),
    primary_key=("grant_id", "message_id"),
    foreign_keys=(
        ForeignKey("audience_mention_uses_grant_fkey", ("grant_id",), "audience_mention_grants", ("id",)),
        tenant_fk("audience_mention_uses", ("workspace_id", "message_id"), "scope_messages", ("workspace_id", "id"),
                  "message"),
    ),
    indexes=(Index("audience_mention_uses_window_idx", "grant_id, used_at"),),
))

# An agent controller's selection (strand-message §9.4.5): may others' mentions reach the agent?
agent_participation_selections = introduced_in(6, Table(
    "agent_participation_selections",
    columns=(
        Column("workspace_id", "text"),
        Column("agent_member_id", "text"),
        Column("accept_third_party_mention", "boolean"),
        Column("version", "integer", default="1"),
        Column("updated_by_member_id", "text"),
        Column("updated_at", TS, default=NOW),
    ),
    primary_key=("workspace_id", "agent_member_id"),
    checks=(Check("agent_participation_selections_version_positive", "version >= 1"),),
    foreign_keys=(
        member_fk("agent_participation_selections", "agent_member_id"),
        member_fk("agent_participation_selections", "updated_by_member_id"),
    ),
))


# --- version 7: attachments and message search ------------------------------------------------

ATTACHMENT_DRIVERS = ("local", "s3")
# collecting: being deleted (by the collector or an abort); its bytes may still exist.
UPLOAD_STATES = ("uploading", "stored", "collecting")


def _upload_columns() -> tuple[Column, ...]:
    """An upload's object, description and state: a workspace attachment's and a platform asset's."""
    return (Column("storage_driver", "text"), Column("storage_object_key", "text"), Column("filename", "text"),
            Column("label", "text"), Column("content_type", "text"), Column("byte_size", "bigint"),
            Column("content_sha256", "text", nullable=True), Column("upload_state", "text", default="'uploading'"),
            Column("payload", "jsonb", default="'{}'::jsonb"), Column("created_at", TS, default=NOW),
            Column("stored_at", TS, nullable=True))


def _upload_checks(table: str) -> tuple[Check, ...]:
    return (
        enum_check(table, "storage_driver", ATTACHMENT_DRIVERS),
        enum_check(table, "upload_state", UPLOAD_STATES),
        Check(f"{table}_byte_size_positive", "byte_size > 0"),
        Check(f"{table}_sha256_format", "content_sha256 IS NULL OR content_sha256 ~ '^[0-9a-f]{64}$'"),
        Check(f"{table}_stored_has_digest",
              "upload_state <> 'stored' OR (content_sha256 IS NOT NULL AND stored_at IS NOT NULL)"),
        Check(f"{table}_uploading_has_no_digest",
              "upload_state <> 'uploading' OR (content_sha256 IS NULL AND stored_at IS NULL)"),
        Check(f"{table}_payload_object", "jsonb_typeof(payload) = 'object'"),
    )

# A file uploaded into a scope (scope-model §3.11): unclaimed (message_id NULL) until a
# message of its uploader in the same scope claims it in the send's transaction.  Reads
# follow the owning message's visibility; the row is never a source of it.
attachments = introduced_in(7, Table(
    "attachments",
    columns=(
        Column("id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("message_id", "text", nullable=True),
        Column("uploaded_by_member_id", "text"),
        *_upload_columns(),
        Column("claimed_at", TS, nullable=True),
        # Its message was withdrawn: unreadable at once, its bytes the collector's.
        Column("released_at", TS, nullable=True),
        # A platform broadcast's attachment: the bytes are this asset's (shared by every workspace
        # the broadcast reached), and storage_object_key names no object of its own.
        Column("platform_asset_id", "text", nullable=True, since=10),
    ),
    primary_key=("id",),
    uniques=(Unique("attachments_object_key", ("storage_driver", "storage_object_key")),),
    checks=(
        id_check("attachments", "id", "att"),
        *_upload_checks("attachments"),
        Check("attachments_claim_needs_stored", "message_id IS NULL OR upload_state IN ('stored', 'collecting')"),
        Check("attachments_claimed_at_with_message", "(message_id IS NULL) = (claimed_at IS NULL)"),
        Check("attachments_released_was_claimed", "released_at IS NULL OR message_id IS NOT NULL"),
    ),
    foreign_keys=(
        tenant_fk("attachments", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"), "scope",
                  on_delete="CASCADE"),
        tenant_fk("attachments", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"), "message",
                  on_delete="CASCADE"),
        member_fk("attachments", "uploaded_by_member_id"),
        ForeignKey("attachments_platform_asset_fkey", ("platform_asset_id",), "platform_service_account_assets",
                   ("id",), on_delete="CASCADE", since=10),
    ),
    indexes=(
        Index("attachments_message_idx", "scope_id, message_id", where="message_id IS NOT NULL"),
        # The GC's scan and the per-member quota: unclaimed uploads by age / by uploader.
        Index("attachments_unclaimed_idx", "created_at", where="message_id IS NULL"),
        Index("attachments_unclaimed_member_idx", "workspace_id, uploaded_by_member_id",
              where="message_id IS NULL"),
        Index("attachments_released_idx", "released_at", where="released_at IS NOT NULL"),
        Index("attachments_collecting_idx", "id", where="upload_state = 'collecting'"),
        Index("attachments_platform_asset_idx", "platform_asset_id", where="platform_asset_id IS NOT NULL",
              since=10),
    ),
))

_GIN_WRITE_THROUGH = (("fastupdate", "off"),)
_GIN_INDEXES = ("scope_message_search_docs_vector_idx", "scope_message_search_docs_mentions_idx")

# The search projection of a visible message (scope-model §3.15): written in the send's
# transaction, rewritten by an edit, deleted by a withdrawal.  Never a source of read
# access: every hit goes through the readable predicate of history.
scope_message_search_docs = introduced_in(7, Table(
    "scope_message_search_docs",
    columns=(
        Column("message_id", "text"),
        Column("workspace_id", "text"),
        Column("scope_id", "text"),
        Column("seq", "bigint"),
        Column("workspace_global_seq", "bigint"),
        Column("author_member_id", "text"),
        Column("created_at", TS),
        Column("has_attachment", "boolean", default="false"),
        Column("mention_member_ids", "text[]", default="'{}'::text[]"),
        # The normalized content and attachment labels: confirms an unsegmented run as a substring.
        Column("search_text", "text"),
        Column("search_vector", "tsvector"),
    ),
    primary_key=("message_id",),
    foreign_keys=(
        tenant_fk("scope_message_search_docs", ("scope_id", "message_id"), "scope_messages", ("scope_id", "id"),
                  "message", on_delete="CASCADE"),
        tenant_fk("scope_message_search_docs", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"),
                  "scope", on_delete="CASCADE"),
    ),
    indexes=(
        # Written straight into the index (version 12): with GIN's default pending list, the
        # send whose insert fills it moves thousands of messages' entries into the index
        # inside its own commit, a 0.1–0.2 s stall of the scope's writes (bench/HISTORY.md).
        Index("scope_message_search_docs_vector_idx", "search_vector", using="gin",
              storage=_GIN_WRITE_THROUGH, storage_since=12),
        # Newest first within the workspace (the result order and the cursor).
        Index("scope_message_search_docs_order_idx", "workspace_id, workspace_global_seq DESC"),
        Index("scope_message_search_docs_scope_idx", "scope_id, workspace_global_seq DESC"),
        # The filters, for searches made of filters alone.
        Index("scope_message_search_docs_author_idx", "workspace_id, author_member_id, workspace_global_seq DESC"),
        Index("scope_message_search_docs_time_idx", "workspace_id, created_at"),
        Index("scope_message_search_docs_attachment_idx", "workspace_id, workspace_global_seq DESC",
              where="has_attachment"),
        Index("scope_message_search_docs_mentions_idx", "mention_member_ids", using="gin",
              storage=_GIN_WRITE_THROUGH, storage_since=12),
    ),
))

SEARCH_STEP_STATES = ("pending", "complete")

# Search readiness per scope (scope-model §3.16): a row for each scope that had messages
# when version 7 was applied, until `scopewire search backfill` and `finalize` make it
# ready.  A scope without a row is ready: it was indexed from its first message.
scope_message_search_state = introduced_in(7, Table(
    "scope_message_search_state",
    columns=(
        Column("scope_id", "text"),
        Column("workspace_id", "text"),
        Column("migration_state", "text", default="'complete'"),
        Column("backfill_state", "text", default="'pending'"),
        Column("finalize_state", "text", default="'pending'"),
        Column("read_ready", "boolean", default="false"),
        # Messages with seq above this are the ones the backfill has yet to index.
        Column("backfill_cursor_seq", "bigint", default="0"),
        Column("backfilled_docs", "bigint", default="0"),
        *timestamps(),
    ),
    primary_key=("scope_id",),
    checks=(
        enum_check("scope_message_search_state", "migration_state", SEARCH_STEP_STATES),
        enum_check("scope_message_search_state", "backfill_state", SEARCH_STEP_STATES),
        enum_check("scope_message_search_state", "finalize_state", SEARCH_STEP_STATES),
        Check("scope_message_search_state_ready_needs_complete",
              "NOT read_ready OR (migration_state = 'complete' AND backfill_state = 'complete' "
              "AND finalize_state = 'complete')"),
        Check("scope_message_search_state_finalize_after_backfill",
              "finalize_state = 'pending' OR backfill_state = 'complete'"),
    ),
    foreign_keys=(
        tenant_fk("scope_message_search_state", ("workspace_id", "scope_id"), "scopes", ("workspace_id", "id"),
                  "scope", on_delete="CASCADE"),
    ),
    indexes=(Index("scope_message_search_state_pending_idx", "workspace_id", where="NOT read_ready"),),
))

# --- scale-out (version 8): nodes, scope ownership leases, the cross-node bus's spill -------------

# A scopewire process serving this database. Its lease (renewed by heartbeat) keeps every
# scope lease it holds alive: one row to renew per node, not one per scope.
cluster_nodes = introduced_in(8, Table(
    "cluster_nodes",
    columns=(
        Column("node_id", "text"),
        # host:port where peers forward commands for the scopes this node owns.
        Column("forward_address", "text"),
        Column("started_at", TS, default=NOW),
        Column("heartbeat_at", TS, default=NOW),
        Column("lease_expires_at", TS),
        Column("stopped_at", TS, nullable=True),
    ),
    primary_key=("node_id",),
    checks=(Check("cluster_nodes_lease_after_heartbeat", "lease_expires_at >= heartbeat_at"),),
    indexes=(Index("cluster_nodes_live_idx", "lease_expires_at", where="stopped_at IS NULL"),),
))

# Which node's actor owns a scope.  `epoch` only grows (a released row keeps it), so a
# former owner's epoch never passes the fence again.  No FK to scopes: a creating actor
# holds the lease before its scope row exists.
scope_leases = introduced_in(8, Table(
    "scope_leases",
    columns=(
        Column("scope_id", "text"),
        Column("node_id", "text", nullable=True),  # NULL: released, free to take
        Column("epoch", "bigint", default="1"),
        Column("acquired_at", TS, default=NOW),
    ),
    primary_key=("scope_id",),
    checks=(
        Check("scope_leases_epoch_positive", "epoch >= 1"),
        id_check("scope_leases", "scope_id", "scp", since=8),
    ),
    foreign_keys=(ForeignKey("scope_leases_node_fkey", ("node_id",), "cluster_nodes", ("node_id",),
                             on_delete="SET NULL"),),
    indexes=(Index("scope_leases_node_idx", "node_id", where="node_id IS NOT NULL"),),
))

# Which node's PlatformAccountActor owns a platform account (version 9): the same rule as
# scope_leases, the row going with its account.
platform_account_leases = introduced_in(9, Table(
    "platform_account_leases",
    columns=(
        Column("platform_service_account_id", "text"),
        Column("node_id", "text", nullable=True),  # NULL: released, free to take
        Column("epoch", "bigint", default="1"),
        Column("acquired_at", TS, default=NOW),
    ),
    primary_key=("platform_service_account_id",),
    checks=(Check("platform_account_leases_epoch_positive", "epoch >= 1"),),
    foreign_keys=(
        ForeignKey("platform_account_leases_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_account_leases_node_fkey", ("node_id",), "cluster_nodes", ("node_id",),
                   on_delete="SET NULL"),
    ),
    indexes=(Index("platform_account_leases_node_idx", "node_id", where="node_id IS NOT NULL"),),
))

# --- version 10: platform broadcast attachments (service-account §4.5) ------------------------------

# An operator's upload for a platform account's broadcasts: staged and checked as a workspace
# attachment is, then frozen once a broadcast references it (never collected while its account
# lives).  Unreferenced ones expire; an account's delete leaves them to the collector (account NULL).
platform_service_account_assets = introduced_in(10, Table(
    "platform_service_account_assets",
    columns=(
        Column("id", "text"),
        Column("platform_service_account_id", "text", nullable=True),
        Column("uploaded_by_operator_id", "text"),
        *_upload_columns(),
        Column("referenced_at", TS, nullable=True),  # the first broadcast that carries it
    ),
    primary_key=("id",),
    uniques=(Unique("platform_service_account_assets_object_key", ("storage_driver", "storage_object_key")),),
    checks=(
        id_check("platform_service_account_assets", "id", "pas"),
        *_upload_checks("platform_service_account_assets"),
        Check("platform_service_account_assets_referenced_was_stored",
              "referenced_at IS NULL OR stored_at IS NOT NULL"),
    ),
    foreign_keys=(
        ForeignKey("platform_service_account_assets_account_fkey", ("platform_service_account_id",),
                   "platform_service_accounts", ("id",), on_delete="SET NULL"),
        ForeignKey("platform_service_account_assets_operator_fkey", ("uploaded_by_operator_id",),
                   "platform_operators", ("id",)),
    ),
    indexes=(
        Index("platform_service_account_assets_account_idx", "platform_service_account_id, id"),
        # The collector: unreferenced uploads by age, and the assets of deleted accounts.
        Index("platform_service_account_assets_unreferenced_idx", "created_at", where="referenced_at IS NULL"),
        Index("platform_service_account_assets_orphan_idx", "id", where="platform_service_account_id IS NULL"),
        Index("platform_service_account_assets_operator_idx", "uploaded_by_operator_id",
              where="referenced_at IS NULL"),
    ),
))

# Delivery asset ordinal → the workspace attachment it became: written in the delivery's message
# transaction, so a delivery's assets are materialized exactly once.
platform_service_account_delivery_assets = introduced_in(10, Table(
    "platform_service_account_delivery_assets",
    columns=(
        Column("delivery_id", "text"),
        Column("asset_ordinal", "integer"),
        Column("workspace_id", "text"),
        Column("asset_id", "text"),
        Column("attachment_id", "text"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("delivery_id", "asset_ordinal"),
    uniques=(Unique("platform_service_account_delivery_assets_attachment_key", ("attachment_id",)),),
    checks=(Check("platform_service_account_delivery_assets_ordinal", "asset_ordinal >= 0"),),
    foreign_keys=(
        ForeignKey("platform_service_account_delivery_assets_delivery_fkey", ("delivery_id",),
                   "platform_service_account_broadcast_deliveries", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_delivery_assets_asset_fkey", ("asset_id",),
                   "platform_service_account_assets", ("id",), on_delete="CASCADE"),
        ForeignKey("platform_service_account_delivery_assets_attachment_fkey", ("attachment_id",),
                   "attachments", ("id",), on_delete="CASCADE"),
    ),
    indexes=(Index("platform_service_account_delivery_assets_asset_idx", "asset_id"),),
))

# Bus messages too big for a NOTIFY payload: the notification names this row instead.
cluster_bus_spill = introduced_in(8, Table(
    "cluster_bus_spill",
    columns=(
        Column("node_id", "text"),
        Column("bus_seq", "bigint"),
        Column("payload", "bytea"),
        Column("created_at", TS, default=NOW),
    ),
    primary_key=("node_id", "bus_seq"),
    indexes=(Index("cluster_bus_spill_created_idx", "created_at"),),
))


# The shared service registrations every installation points at (service-account.md §2.1).  A
# first use that inserted them inside a create or provisioning transaction held the new row
# while it went on to lock workspaces, and deadlocked against another workspace's create
# waiting on that row; registered once here, those transactions only read them.  A database
# that registered them on first use before version 11 keeps its rows (ON CONFLICT).
_BUILT_IN_SERVICE_REGISTRATIONS = tuple(
    statement
    for definition_id, capability_id, slug, kind, mode, contract in (
        ("sdf_serviceaccount", "cap_serviceaccount", SERVICE_ACCOUNT_SLUG, "service_account", "named_multi_instance",
         "service_account_message"),
        ("sdf_approvalsapp00", "cap_approvalsapp00", APPROVALS_SLUG, "app", "workspace_singleton",
         "app_notification"),
    )
    for statement in (
        "INSERT INTO service_definitions (id, service_kind, slug, installation_mode) "
        f"VALUES ('{definition_id}', '{kind}', '{slug}', '{mode}') ON CONFLICT (slug) DO NOTHING",
        "INSERT INTO service_capabilities (id, service_definition_id, capability, delivery_contract) "
        f"SELECT '{capability_id}', id, '{MESSAGE_WRITE}', '{contract}' FROM service_definitions WHERE slug = '{slug}' "
        "ON CONFLICT DO NOTHING",
    )
)

SCHEMA = Schema(
    tables=(
        instance_metadata,
        accounts,
        local_credentials,
        workspaces,
        workspace_execution_states,
        workspace_memberships,
        members,
        workspace_invitations,
        api_keys,
        scopes,
        scope_channel_profiles,
        scope_memberships,
        scope_notification_settings,
        scope_private_grants,
        scope_messages,
        scope_message_revisions,
        workspace_message_counters,
        scope_message_sources,
        scope_activity_events,
        scope_fanout_outbox,
        scope_message_reactions,
        conversation_member_states,
        scope_executions,
        task_scope_participant_metadata,
        task_collaborator_events,
        task_collaborator_notification_jobs,
        member_delivery_feeds,
        scope_targeted_deliveries,
        service_definitions,
        service_capabilities,
        service_installations,
        service_members,
        service_grants,
        service_target_bindings,
        service_accounts,
        service_account_managers,
        service_account_create_requests,
        service_account_name_namespaces,
        service_account_name_claims,
        service_account_audit_events,
        service_account_workspace_policies,
        workspace_human_lifecycle_events,
        approval_instances,
        approval_notification_intents,
        service_notification_cards,
        scope_message_pins,
        platform_operators,
        platform_operator_keys,
        platform_service_accounts,
        platform_service_account_provisioning_inputs,
        platform_service_account_workspace_instances,
        platform_service_account_broadcasts,
        platform_service_account_broadcast_deliveries,
        workspace_placements,
        platform_moderation_logs,
        platform_service_account_audit_events,
        task_boards,
        strands,
        strand_synthesis_revisions,
        strand_assignments,
        strand_watches,
        strand_audit_events,
        workspace_default_strands,
        audience_mention_policies,
        audience_mention_grants,
        audience_mention_uses,
        agent_participation_selections,
        attachments,
        scope_message_search_docs,
        scope_message_search_state,
        cluster_nodes,
        scope_leases,
        cluster_bus_spill,
        platform_account_leases,
        platform_service_account_assets,
        platform_service_account_delivery_assets,
    ),
    versions=(
        Version(1, "tenancy kernel and message domain",
                before=tuple(f"CREATE EXTENSION IF NOT EXISTS {name}" for name in EXTENSIONS)),
        Version(2, "private agents: grant windows, Scope Executions, People collaborators", after=(
            # From version 2 these metadata keys are written by the server (explicit
            # recipients, owner_quote copies); a version-1 client could have used
            # them freely, so its values move aside instead of acting as routing facts.
            "UPDATE scope_messages SET metadata = (metadata - 'recipients' - 'quote' - 'shared_by_member_id') "
            "|| jsonb_strip_nulls(jsonb_build_object('client_recipients', metadata -> 'recipients', "
            "'client_quote', metadata -> 'quote', 'client_shared_by_member_id', metadata -> 'shared_by_member_id')) "
            "WHERE metadata ?| array['recipients', 'quote', 'shared_by_member_id']",
        )),
        Version(3, "routed delivery: per-recipient delivery feeds and the sparse targeted delivery ledger"),
        Version(4, "workspace service accounts: Service Actor substrate, accounts, create requests, approvals, "
                   "managers, audit, human lifecycle, shared pins"),
        Version(5, "platform service accounts: operators, provisioning generations, workspace instances, "
                   "broadcasts, fenced deliveries, workspace placements, moderation log"),
        Version(6, "strands: task boards, strand rows, assignments, watches, the default strand, "
                   "audience-mention policy and grants, agent participation"),
        Version(7, "attachments and message search: uploads claimed by messages, the search projection "
                   "and its readiness", after=(
            # Messages written before version 7 have no search docs yet: their scopes stay
            # unsearchable until `scopewire search backfill` and `finalize` (§3.16).
            "INSERT INTO scope_message_search_state (scope_id, workspace_id) "
            "SELECT id, workspace_id FROM scopes WHERE latest_seq > 0 ON CONFLICT DO NOTHING",
        )),
        Version(8, "scale-out: nodes, scope ownership leases with fencing epochs, the cross-node bus's spill"),
        Version(9, "scale-out: platform account ownership leases with fencing epochs"),
        Version(10, "platform broadcast attachments: operators' assets, the broadcast's frozen asset manifest, "
                    "per-delivery asset mappings to workspace attachments"),
        Version(11, "the Service Actor substrate's two built-in registrations, registered here instead of on "
                    "first use", after=_BUILT_IN_SERVICE_REGISTRATIONS),
        Version(12, "the search projection's GIN indexes without a pending list (fastupdate off)", before=tuple(
            # What the pending lists hold moves into the indexes now, while fastupdate is still on.
            f"SELECT gin_clean_pending_list('{name}'::regclass)" for name in _GIN_INDEXES)),
    ),
    extensions=EXTENSIONS,
)
