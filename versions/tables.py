"""The registry's rows, in the tenant database (`tenants.models.Base`; migration 0003_model_registry).

    registry_models        one row per public name
    registry_versions      (model, version) -> source, dtype, state, fingerprint, who/when
    registry_generations   (model, generation) -> {version: weight}: the alias's whole history; the
                           newest row is the alias now. Its primary key makes a change a
                           compare-and-set: two admins writing generation g+1 cannot both succeed.
    registry_changes       every change, with its time and the admin who made it
    registry_tenant_access (tenant, model) -> pinned version or none: a tenant with rows may use only
                           those models, each pinned to one version where a version is given
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from tenants.models import Base, UTCDateTime, utcnow


class RegistryModel(Base):
    __tablename__ = "registry_models"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200))


class RegistryVersion(Base):
    __tablename__ = "registry_versions"
    __table_args__ = (UniqueConstraint("model", "version", name="uq_registry_versions_model_version"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    model: Mapped[str] = mapped_column(ForeignKey("registry_models.name", ondelete="CASCADE"))
    version: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(1000))
    dtype: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    # Sent as `system_fingerprint` with every response the version produces.
    fingerprint: Mapped[str] = mapped_column(String(40))
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)  # why the last deploy failed
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200))
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(200))


class RegistryGeneration(Base):
    __tablename__ = "registry_generations"

    model: Mapped[str] = mapped_column(ForeignKey("registry_models.name", ondelete="CASCADE"), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    weights: Mapped[dict[str, int]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200))


class RegistryChange(Base):
    __tablename__ = "registry_changes"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    model: Mapped[str] = mapped_column(String(100), index=True)  # no foreign key: the log outlives rows
    version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    action: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class RegistryTenantAccess(Base):
    __tablename__ = "registry_tenant_access"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(ForeignKey("registry_models.name", ondelete="CASCADE"), primary_key=True)
    version: Mapped[str | None] = mapped_column(String(64), nullable=True)  # None: whatever the alias says
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200))
