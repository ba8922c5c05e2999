-- Run once by the postgres image on an empty data folder (docker-entrypoint-initdb.d):
-- the MLflow basic-auth app keeps its users and permissions in a database of its own.
CREATE DATABASE mlflow_auth OWNER mlflow;
