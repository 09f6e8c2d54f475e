"""The admission service: the HTTP API through which tenants submit, follow and cancel
jobs. It validates and stores each job, then hands it to the scheduler over NATS."""

from gpusched.services.admission.app import AdmissionApi, make_app
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.service import AdmissionService, serve

__all__ = ["AdmissionApi", "AdmissionConfig", "AdmissionService", "make_app", "serve"]
