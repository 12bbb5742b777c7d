//go:build tools

// Package tools pins helm for the chart tests (lint, template, install).
package tools

import _ "helm.sh/helm/v3/cmd/helm"
