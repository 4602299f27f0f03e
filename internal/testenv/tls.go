package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// testTLS is a certificate authority made for one server and the
// certificate it issued that server for 127.0.0.1 and localhost, as PEM
// files in a temporary folder.
type testTLS struct {
	dir                       string
	caFile, certFile, keyFile string
	pool                      *x509.CertPool
}

func newTestTLS() (*testTLS, error) {
	dir, err := os.MkdirTemp("", "picomq-tls-")
	if err != nil {
		return nil, err
	}
	tt := &testTLS{
		dir:      dir,
		caFile:   filepath.Join(dir, "ca.pem"),
		certFile: filepath.Join(dir, "cert.pem"),
		keyFile:  filepath.Join(dir, "key.pem"),
	}
	if err := tt.issue(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("testenv: make a test certificate: %w", err)
	}
	return tt, nil
}

// issue makes the authority and the server's certificate and writes them.
func (tt *testTLS) issue() error {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	ca := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "picomq test authority"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	for _, f := range []struct {
		path, typ string
		der       []byte
	}{
		{tt.caFile, "CERTIFICATE", caDER},
		{tt.certFile, "CERTIFICATE", leafDER},
		{tt.keyFile, "PRIVATE KEY", keyDER},
	} {
		data := pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: f.der})
		if err := os.WriteFile(f.path, data, 0o600); err != nil {
			return err
		}
	}
	tt.pool = x509.NewCertPool()
	tt.pool.AddCert(caCert)
	return nil
}

func (tt *testTLS) remove() error { return os.RemoveAll(tt.dir) }

// transport returns a transport that trusts the server's authority, or
// nil (the default transport) when the server speaks plain HTTP.
func (v *Versity) transport() http.RoundTripper {
	if v.tls == nil {
		return nil
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: v.tls.pool}
	return tr
}
