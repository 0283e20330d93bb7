from __future__ import annotations

from django.apps import AppConfig


class IncidentsConfig(AppConfig):
    name = "incidents"
    verbose_name = "Incidents"

    def ready(self) -> None:
        # Collectors announce stored signals; diagnosis listens (DESIGN: data goes one way).
        from collectors.services import signals_stored
        from incidents.diagnosing import signals_stored_received

        signals_stored.connect(signals_stored_received, dispatch_uid="incidents.diagnosis")

        # Step notifications are recorded as incidents' deliveries: collectors' notifier
        # reaches them through this port, since collectors import nothing of incidents.
        from collectors.clients.notify import delivery_log_set
        from incidents.deliveries import StepDeliveries

        delivery_log_set(StepDeliveries())

        # The fleet's pages and API (collectors) show a node's and a job's incidents and
        # audit a refused push through these: they ask, incidents answer.
        from collectors.api.views import push_refused
        from collectors.selectors import job_page, node_page
        from incidents.api.middleware import push_refused_record
        from incidents.selectors import job_page_incidents, node_page_incidents

        node_page.connect(node_page_incidents, dispatch_uid="incidents.node_page")
        job_page.connect(job_page_incidents, dispatch_uid="incidents.job_page")
        push_refused.connect(push_refused_record, dispatch_uid="incidents.push_refused")
