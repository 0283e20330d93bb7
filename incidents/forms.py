"""The incident page's on-call forms: what a person types, checked before a service sees it.
A form that does not validate is shown again with what was typed and why it was refused."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.auth import get_user_model

from incidents import selectors
from incidents.models import Severity
from incidents.oncall import NOTE_KEY_MAX_CHARS, NOTE_MAX_CHARS

# incidents.lifecycle.incident_resolve_by_hand keeps this much of a resolve note (and the API's
# ResolveSerializer takes no more): refused here rather than cut short there.
RESOLVE_NOTE_MAX_CHARS = 500


class NoteForm(forms.Form):
    text = forms.CharField(max_length=NOTE_MAX_CHARS, strip=True,
                           widget=forms.Textarea(attrs={"rows": 3}),
                           error_messages={"required": "A note needs some text."})
    # One per rendered form: the same form sent twice adds one note (incidents.oncall).
    key = forms.CharField(max_length=NOTE_KEY_MAX_CHARS, required=False,
                          widget=forms.HiddenInput)


class ResolveForm(forms.Form):
    note = forms.CharField(max_length=RESOLVE_NOTE_MAX_CHARS, required=False, strip=True,
                           widget=forms.Textarea(attrs={"rows": 2}),
                           help_text="Why it is over: fixed by hand, not a fault, ...")


class SeverityForm(forms.Form):
    severity = forms.ChoiceField(choices=Severity.choices)


class AssignForm(forms.Form):
    """An owner among the people who may act (operators, admins); empty: nobody."""

    owner = forms.ModelChoiceField(queryset=get_user_model().objects.none(), required=False,
                                   to_field_name="username", empty_label="nobody")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["owner"]
        assert isinstance(field, forms.ModelChoiceField)
        field.queryset = selectors.oncall_people()
