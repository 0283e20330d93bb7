from __future__ import annotations

from django.apps import AppConfig


class IncidentsConfig(AppConfig):
    name = "incidents"
    verbose_name = "Incidents"

    def ready(self) -> None:
        # Collectors announce stored signals; diagnosis listens (DESIGN: data goes one way).
        from collectors.services import signals_stored
        from incidents.services import signals_stored_received

        signals_stored.connect(signals_stored_received, dispatch_uid="incidents.diagnosis")

        # Step notifications are recorded as incidents' deliveries: collectors' notifier
        # reaches them through this port, since collectors import nothing of incidents.
        from collectors.clients.notify import delivery_log_set
        from incidents.deliveries import StepDeliveries

        delivery_log_set(StepDeliveries())
