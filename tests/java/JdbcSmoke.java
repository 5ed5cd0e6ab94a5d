import java.sql.Connection;
import java.sql.DatabaseMetaData;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.Properties;

/**
 * JDBC smoke test for dpsql serve: connect, DatabaseMetaData.getTables/getColumns, a DP query,
 * a prepared DP query with a parameter, and a refusal. Prints one "KEY value" line per check;
 * the Python test asserts on them. Usage: java -cp postgresql.jar JdbcSmoke.java URL USER PASS
 */
public class JdbcSmoke {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.setProperty("user", args[1]);
        props.setProperty("password", args[2]);
        try (Connection conn = DriverManager.getConnection(args[0], props)) {
            try (Statement st = conn.createStatement()) {
                st.execute("SET epsilon = 0.1");  // a small share of the budget per query
            }
            DatabaseMetaData meta = conn.getMetaData();
            System.out.println("PRODUCT " + meta.getDatabaseProductName() + " "
                    + meta.getDatabaseProductVersion());
            try (ResultSet rs = meta.getTables(null, "public", "%", new String[] {"TABLE"})) {
                while (rs.next()) {
                    System.out.println("TABLE " + rs.getString("TABLE_SCHEM") + "."
                            + rs.getString("TABLE_NAME") + " " + rs.getString("TABLE_TYPE"));
                }
            }
            try (ResultSet rs = meta.getColumns(null, "public", "visits", "%")) {
                while (rs.next()) {
                    System.out.println("COLUMN " + rs.getString("COLUMN_NAME") + " "
                            + rs.getString("TYPE_NAME") + " " + rs.getInt("DATA_TYPE") + " "
                            + rs.getString("IS_NULLABLE"));
                }
            }
            // what BI tools call while browsing (Metabase, DBeaver): must not fail
            String[] kinds = {"TABLE", "PARTITIONED TABLE", "VIEW", "FOREIGN TABLE",
                    "MATERIALIZED VIEW"};
            System.out.println("BROWSE schemas=" + count(meta.getSchemas())
                    + " catalogs=" + count(meta.getCatalogs())
                    + " tables=" + count(meta.getTables(null, null, "%", kinds))
                    + " pk=" + count(meta.getPrimaryKeys(null, "public", "visits"))
                    + " fk=" + count(meta.getImportedKeys(null, "public", "visits"))
                    + " idx=" + count(meta.getIndexInfo(null, "public", "visits", false, true))
                    + " types=" + (count(meta.getTypeInfo()) > 0)
                    + " procs=" + count(meta.getProcedures(null, "public", "%")));
            try (Statement st = conn.createStatement();
                    ResultSet rs = st.executeQuery(
                            "SELECT department, COUNT(*) AS n FROM visits GROUP BY department"
                                    + " ORDER BY department")) {
                while (rs.next()) {
                    System.out.println("DP " + rs.getString(1) + " " + rs.getLong(2));
                }
            }
            try (PreparedStatement ps = conn.prepareStatement(
                    "SELECT COUNT(*) AS n FROM visits WHERE age >= ?")) {
                ps.setInt(1, 40);
                try (ResultSet rs = ps.executeQuery()) {
                    rs.next();
                    System.out.println("PREPARED " + rs.getMetaData().getColumnTypeName(1) + " "
                            + rs.getLong(1));
                }
            }
            // past prepareThreshold (5) the driver switches to a named server-side statement
            // and binary transfer: run it 7 times with a date parameter
            try (PreparedStatement ps = conn.prepareStatement(
                    "SELECT smoker, COUNT(*) AS n, AVG(cost) AS c FROM visits"
                            + " WHERE visit_date >= ? GROUP BY smoker ORDER BY smoker")) {
                int groups = 0;
                for (int i = 0; i < 7; i++) {
                    ps.setDate(1, java.sql.Date.valueOf("2024-0" + (1 + i) + "-01"));
                    try (ResultSet rs = ps.executeQuery()) {
                        while (rs.next()) {
                            rs.getBoolean(1);
                            rs.getLong(2);
                            rs.getDouble(3);
                            groups++;
                        }
                    }
                }
                System.out.println("REPEATED " + groups);
            }
            try (Statement st = conn.createStatement()) {
                st.executeQuery("SELECT * FROM visits LIMIT 100");
                System.out.println("REFUSAL none");
            } catch (SQLException e) {
                System.out.println("REFUSAL " + e.getSQLState());
            }
        }
        System.out.println("DONE");
    }

    private static int count(ResultSet rs) throws SQLException {
        int n = 0;
        try (rs) {
            while (rs.next()) {
                n++;
            }
        }
        return n;
    }
}
