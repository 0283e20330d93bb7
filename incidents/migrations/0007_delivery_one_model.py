"""One delivery model: webhook subscription deliveries and step notifications in one table.

WebhookDelivery becomes Delivery (its rows are subscription deliveries, ``channel``
"subscription"); the fields a step's notification needs are added; the next migration copies
collectors.Delivery's rows in."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('incidents', '0006_diagnosis_state'),
    ]

    operations = [
        migrations.RenameModel(
            old_name='WebhookDelivery',
            new_name='Delivery',
        ),
        migrations.AlterModelOptions(
            name='delivery',
            options={'ordering': ['-created_at', '-id'], 'verbose_name_plural': 'deliveries'},
        ),
        migrations.AddField(
            model_name='delivery',
            name='channel',
            field=models.CharField(choices=[('subscription', 'webhook subscription'), ('webhook', 'notification webhook'), ('slack', 'Slack-compatible webhook'), ('email', 'e-mail')], default='subscription', max_length=16),
        ),
        migrations.AddField(
            model_name='delivery',
            name='target',
            field=models.CharField(blank=True, default='', help_text='URL or addresses, never a secret', max_length=300),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name='delivery',
            name='subject',
            field=models.CharField(blank=True, default='', max_length=300),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name='delivery',
            name='event',
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AlterField(
            model_name='delivery',
            name='event_id',
            field=models.CharField(blank=True, help_text='the same on every retry (notifications: their key)', max_length=64),
        ),
        migrations.AlterField(
            model_name='delivery',
            name='payload',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AlterField(
            model_name='delivery',
            name='incident',
            field=models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='deliveries', to='incidents.incident'),
        ),
        migrations.AlterField(
            model_name='delivery',
            name='subscription',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='deliveries', to='incidents.webhooksubscription'),
        ),
    ]
