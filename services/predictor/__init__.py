"""The predictor service: iterations, throughput and co-location slowdown of training
jobs, from the profiles corrected by what running jobs measured."""

from gpusched.libs.common.predictor_client import (
    PredictorClient,
    PredictorClientError,
    PredictorError,
    PredictorUnavailable,
)
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.model import BaselinePredictor, InvalidRequest
from gpusched.services.predictor.service import PredictorService

__all__ = [
    "BaselinePredictor",
    "InvalidRequest",
    "PredictorClient",
    "PredictorClientError",
    "PredictorConfig",
    "PredictorError",
    "PredictorService",
    "PredictorUnavailable",
]
