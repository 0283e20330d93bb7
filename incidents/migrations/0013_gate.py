import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("collectors", "0015_node_k8s_labels_taints"),
        ("incidents", "0012_incident_fail_slow"),
    ]

    operations = [
        migrations.CreateModel(
            name="GateRun",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("node", models.CharField(db_index=True, max_length=128)),
                ("key", models.CharField(max_length=64, unique=True)),
                ("repair", models.CharField(help_text="what was done to the node before", max_length=16)),
                ("reason", models.TextField(blank=True, help_text="why it was asked for")),
                ("requested_by", models.CharField(default="system", max_length=150)),
                ("mode", models.CharField(choices=[("auto", "auto"), ("approve", "approve first"), ("observe", "observe only")], default="auto", max_length=16)),
                ("status", models.CharField(choices=[("awaiting_approval", "awaiting approval"), ("running", "running"), ("passed", "passed: in service"), ("failed", "failed: held"), ("cannot_run", "could not run: held"), ("unchecked", "no check configured"), ("observed", "observed (no action taken)"), ("cancelled", "cancelled")], default="running", max_length=20)),
                ("checks", models.JSONField(blank=True, default=list, help_text="the checks it runs")),
                ("detail", models.TextField(blank=True, help_text="what it is doing, or its verdict")),
                ("state", models.JSONField(blank=True, default=dict)),
                ("done_calls", models.JSONField(blank=True, default=list)),
                ("created_at", models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("lease_until", models.DateTimeField(blank=True, null=True)),
                ("next_check_at", models.DateTimeField(blank=True, db_index=True, null=True)),
                ("cluster", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="gate_runs", to="collectors.cluster")),
                ("remediation", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="gate_runs", to="incidents.remediation")),
                ("step", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="gate_runs", to="incidents.step")),
            ],
            options={
                "ordering": ["-created_at", "-id"],
            },
        ),
    ]
