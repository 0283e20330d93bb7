"""Step notifications are recorded in incidents.Delivery now (one delivery model); incidents'
migration 0008 copied this table's rows there before this one drops it."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('collectors', '0007_push_receipts_safe_signal_data'),
    ]

    operations = [
        migrations.DeleteModel(
            name='Delivery',
        ),
    ]
