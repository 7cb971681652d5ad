"""The vocabulary the schema is written in, and how it renders to DDL.

Every element carries `since`, the schema version that introduced it.  The
migration to version N is derived from the definition: the tables, columns,
constraints and indexes whose `since == N`.  Bootstrap is "apply every version
in order", and verification renders the same definition into a scratch schema
and compares catalogs, so all three come from one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    nullable: bool = False
    default: str | None = None
    since: int = 1

    def ddl(self) -> str:
        parts = [self.name, self.type]
        if self.default is not None:
            parts.append(f"DEFAULT {self.default}")
        if not self.nullable:
            parts.append("NOT NULL")
        return " ".join(parts)


@dataclass(frozen=True)
class Unique:
    name: str
    columns: tuple[str, ...]
    since: int = 1

    def ddl(self) -> str:
        return f"CONSTRAINT {self.name} UNIQUE ({', '.join(self.columns)})"


@dataclass(frozen=True)
class Check:
    name: str
    expression: str
    since: int = 1
    # The version that dropped it (a check replaced by a wider one keeps its old
    # definition here, so every version's DDL still comes from this one place).
    until: int | None = None

    def ddl(self) -> str:
        return f"CONSTRAINT {self.name} CHECK ({self.expression})"


@dataclass(frozen=True)
class Exclude:
    name: str
    using: str
    elements: str
    where: str | None = None
    since: int = 1

    def ddl(self) -> str:
        where = f" WHERE ({self.where})" if self.where else ""
        return f"CONSTRAINT {self.name} EXCLUDE USING {self.using} ({self.elements}){where}"


@dataclass(frozen=True)
class ForeignKey:
    name: str
    columns: tuple[str, ...]
    ref_table: str
    ref_columns: tuple[str, ...]
    on_delete: str | None = None
    since: int = 1

    def ddl(self) -> str:
        on_delete = f" ON DELETE {self.on_delete}" if self.on_delete else ""
        return (
            f"CONSTRAINT {self.name} FOREIGN KEY ({', '.join(self.columns)}) "
            f"REFERENCES {self.ref_table} ({', '.join(self.ref_columns)}){on_delete}"
        )


@dataclass(frozen=True)
class Index:
    name: str
    keys: str
    unique: bool = False
    using: str = "btree"
    where: str | None = None
    since: int = 1
    # Storage parameters (`WITH (name = value, ...)`) and the version that set them: an
    # index built by an earlier version gets them from that version's ALTER INDEX.
    storage: tuple[tuple[str, str], ...] = ()
    storage_since: int = 1

    def ddl(self, table: str, version: int) -> str:
        unique = "UNIQUE " if self.unique else ""
        storage = f" WITH ({self._storage()})" if self.storage and self.storage_since <= version else ""
        where = f" WHERE {self.where}" if self.where else ""
        return f"CREATE {unique}INDEX {self.name} ON {table} USING {self.using} ({self.keys}){storage}{where}"

    def alter_storage_ddl(self) -> str:
        return f"ALTER INDEX {self.name} SET ({self._storage()})"

    def _storage(self) -> str:
        return ", ".join(f"{name} = {value}" for name, value in self.storage)


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]
    uniques: tuple[Unique, ...] = ()
    checks: tuple[Check, ...] = ()
    excludes: tuple[Exclude, ...] = ()
    foreign_keys: tuple[ForeignKey, ...] = ()
    indexes: tuple[Index, ...] = ()
    since: int = 1

    def constraints(self) -> tuple[Unique | Check | Exclude, ...]:
        return (*self.uniques, *self.checks, *self.excludes)

    def create_ddl(self, version: int) -> str:
        lines = [c.ddl() for c in self.columns if c.since <= version]
        lines.append(f"CONSTRAINT {self.name}_pkey PRIMARY KEY ({', '.join(self.primary_key)})")
        lines.extend(c.ddl() for c in self.constraints()
                     if c.since <= version and (getattr(c, "until", None) is None or c.until > version))
        body = ",\n    ".join(lines)
        return f"CREATE TABLE {self.name} (\n    {body}\n)"


def introduced_in(version: int, table: Table) -> Table:
    """`table` as a whole added by `version`: it and every element of it carry that `since`."""
    from dataclasses import replace

    def stamp(elements):
        return tuple(replace(e, since=max(e.since, version)) for e in elements)

    return replace(table, since=version, columns=stamp(table.columns), uniques=stamp(table.uniques),
                   checks=stamp(table.checks), excludes=stamp(table.excludes),
                   foreign_keys=stamp(table.foreign_keys), indexes=stamp(table.indexes))


@dataclass(frozen=True)
class Version:
    """One schema version: its number, a name, and SQL run before/after its DDL
    (extensions before, data backfills after)."""

    number: int
    name: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Schema:
    tables: tuple[Table, ...]
    versions: tuple[Version, ...]
    extensions: tuple[str, ...] = field(default=())

    @property
    def latest_version(self) -> int:
        return self.versions[-1].number

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)

    def statements_for(self, version: int) -> list[str]:
        """The DDL that takes a database from version-1 to `version` (without the
        version's `before`/`after` SQL, which the migration runner adds).

        Order: new tables (columns, keys, checks) → new columns of existing
        tables → new constraints of existing tables → every new foreign key
        (after all tables exist, so cycles need no special casing) → indexes
        → new storage parameters of existing indexes.
        """
        statements: list[str] = []
        new_tables = [t for t in self.tables if t.since == version]
        old_tables = [t for t in self.tables if t.since < version]
        statements += [t.create_ddl(version) for t in new_tables]
        for table in old_tables:
            statements += [
                f"ALTER TABLE {table.name} ADD COLUMN {c.ddl()}"
                for c in table.columns
                if c.since == version
            ]
            statements += [
                f"ALTER TABLE {table.name} DROP CONSTRAINT {c.name}"
                for c in table.checks
                if c.until == version
            ]
            statements += [
                f"ALTER TABLE {table.name} ADD {c.ddl()}"
                for c in table.constraints()
                if c.since == version
            ]
        for table in self.tables:
            statements += [
                f"ALTER TABLE {table.name} ADD {fk.ddl()}"
                for fk in table.foreign_keys
                if fk.since == version or (table.since == version and fk.since < version)
            ]
            statements += [
                ix.ddl(table.name, version)
                for ix in table.indexes
                if ix.since == version or (table.since == version and ix.since < version)
            ]
            statements += [
                ix.alter_storage_ddl()
                for ix in table.indexes
                if ix.storage and ix.storage_since == version and ix.since < version
            ]
        return statements

    def validate(self) -> None:
        """Structural checks on the definition itself (run by the tests)."""
        numbers = [v.number for v in self.versions]
        assert numbers == list(range(1, len(numbers) + 1)), "versions must be 1..N"
        names: set[str] = set()
        for table in self.tables:
            assert 1 <= table.since <= self.latest_version, table.name
            column_names = {c.name for c in table.columns}
            assert len(column_names) == len(table.columns), f"duplicate column in {table.name}"
            assert set(table.primary_key) <= column_names, table.name
            elements = (*table.constraints(), *table.foreign_keys, *table.indexes)
            for element in (*table.columns, *elements):
                assert table.since <= element.since <= self.latest_version, (table.name, element)
                until = getattr(element, "until", None)
                assert until is None or element.since < until <= self.latest_version, (table.name, element)
            for index in table.indexes:
                assert index.storage_since == 1 or index.since <= index.storage_since <= self.latest_version, index
            for element in elements:
                assert element.name not in names, f"duplicate name {element.name}"
                names.add(element.name)
            for fk in table.foreign_keys:
                assert set(fk.columns) <= column_names, fk.name
                assert fk.ref_table in {t.name for t in self.tables}, fk.name
